#!/usr/bin/env python3
"""Keep a sweep's finished runs in git: write RUN_DIR/metrics.jsonl.gz for every run under DIR that exited 0
at its last step (the sweep's job-state record and its metrics agree), so that the results can be committed
without checkpoints, and a sweep resumed on another machine counts those runs as finished
(sweep/local.py reads the archived metrics when the checkpoints are absent).

    tools/archive_runs.py results/toy-calibration     # then: git add results/toy-calibration

What is committed is set by DIR/.gitignore (config.yaml, metrics.jsonl.gz, logs/job-state)."""
from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from m2po_megatron.run.metrics import read_metrics  # noqa: E402
from m2po_megatron.sweep.local import _state_lines  # noqa: E402


def finished(run: Path) -> bool:
    import yaml

    lines = _state_lines(run)
    if not lines or lines[-1][0] != "EXIT" or lines[-1][-1].split("=")[-1] != "0":
        return False
    steps = int(yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"])
    rows = read_metrics(run / "metrics.jsonl")
    return bool(rows) and max(int(r["step"]) for r in rows) >= steps


def archive(run: Path) -> Path:
    out = run / "metrics.jsonl.gz"
    data = (run / "metrics.jsonl").read_bytes()
    with open(out, "wb") as raw, gzip.GzipFile(filename="metrics.jsonl", mode="wb", fileobj=raw, mtime=0,
                                               compresslevel=9) as f:
        f.write(data)  # mtime 0: the same metrics give the same bytes, so git sees no change on a rerun
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path, help="a sweep's output_dir")
    args = ap.parse_args(argv)
    runs = sorted(p.parent for p in args.dir.glob("*/metrics.jsonl"))
    if not runs:
        print(f"archive_runs: no run with a metrics.jsonl under {args.dir}", file=sys.stderr)
        return 2
    done = [r for r in runs if (r / "config.yaml").is_file() and finished(r)]
    for r in done:
        out = archive(r)
        print(f"{out} ({out.stat().st_size // 1024} KiB)")
    print(f"{len(done)} of {len(runs)} runs finished and archived")
    return 0


if __name__ == "__main__":
    sys.exit(main())
