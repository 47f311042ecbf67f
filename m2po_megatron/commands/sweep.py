"""`m2po sweep SWEEP.yaml [--dry-run]` submits a grid of runs to Slurm; `m2po sweep SWEEP.yaml --local [-j N]`
runs them on this machine instead, N at a time (same run names and directories; run it again to skip the
finished runs and resume the others); `m2po sweep TARGET --status` (or `m2po sweep status TARGET`) shows
each run's state and its latest metrics, for Slurm and local sweeps alike (TARGET: the sweep file, its
output dir or its manifest)."""
from __future__ import annotations

import argparse
import json
import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sweep",
        help="submit a grid of runs to Slurm (job arrays) or run it here (--local), or show its state (--status)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", nargs="+", metavar="SWEEP.yaml | status TARGET",
                   help="a sweep file to submit, or `status` followed by the sweep file / output dir / manifest")
    p.add_argument("--dry-run", action="store_true",
                   help="print the sbatch commands (with --local: each run's state and command); start nothing")
    p.add_argument("--local", action="store_true",
                   help="run the sweep on this machine (m2po train ... --resume auto per run) instead of Slurm")
    p.add_argument("-j", "--jobs", type=int, default=1, metavar="N", help="--local: runs at a time (default 1)")
    p.add_argument("--status", action="store_true", help="show each run's state and latest metrics")
    p.add_argument("--json", action="store_true", help="status: print JSON rows")
    p.add_argument("--keys", default=None, help="status: comma-separated metric keys to show")
    p.set_defaults(func=handler)


def handler(args) -> int:
    from m2po_megatron.sweep import grid as sweep

    try:
        if args.target[0] == "status" or args.status:
            target = args.target[1:] if args.target[0] == "status" else args.target
            if len(target) != 1:
                print("usage: m2po sweep SWEEP.yaml|OUTPUT_DIR|MANIFEST --status", file=sys.stderr)
                return 2
            from m2po_megatron.sweep.status import format_status, status

            rows = status(target[0])
            if args.json:
                print(json.dumps(rows, indent=1))
            else:
                print(format_status(rows, args.keys.split(",") if args.keys else None))
            return 0
        if len(args.target) != 1:
            print("usage: m2po sweep SWEEP.yaml [--dry-run | --local [-j N]]", file=sys.stderr)
            return 2
        if args.local:
            from m2po_megatron.sweep.local import run_local

            left = run_local(args.target[0], parallel=args.jobs, dry_run=args.dry_run)
            return 1 if left and not args.dry_run else 0
        sweep.submit(args.target[0], dry_run=args.dry_run)
        return 0
    except sweep.SweepError as e:
        print(f"m2po sweep: {e}", file=sys.stderr)
        return 2
