"""`m2po sweep SWEEP.yaml [--dry-run]` submits a grid of runs to Slurm; `m2po sweep status TARGET` shows
each run's Slurm state and its latest metrics (TARGET: the sweep file, its output dir or its manifest)."""
from __future__ import annotations

import argparse
import json
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sweep",
        help="submit a grid of runs to Slurm (job arrays), or show their state: m2po sweep status SWEEP",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", nargs="+", metavar="SWEEP.yaml | status TARGET",
                   help="a sweep file to submit, or `status` followed by the sweep file / output dir / manifest")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch commands; submit nothing")
    p.add_argument("--json", action="store_true", help="status: print JSON rows")
    p.add_argument("--keys", default=None, help="status: comma-separated metric keys to show")
    p.set_defaults(func=handler)


def handler(args) -> int:
    from m2po_megatron import sweep

    try:
        if args.target[0] == "status":
            if len(args.target) != 2:
                print("usage: m2po sweep status SWEEP.yaml|OUTPUT_DIR|MANIFEST", file=sys.stderr)
                return 2
            rows = sweep.status(args.target[1])
            if args.json:
                print(json.dumps(rows, indent=1))
            else:
                print(sweep.format_status(rows, args.keys.split(",") if args.keys else None))
            return 0
        if len(args.target) != 1:
            print("usage: m2po sweep SWEEP.yaml [--dry-run]", file=sys.stderr)
            return 2
        sweep.submit(args.target[0], dry_run=args.dry_run)
        return 0
    except sweep.SweepError as e:
        print(f"m2po sweep: {e}", file=sys.stderr)
        return 2
