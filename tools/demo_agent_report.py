#!/usr/bin/env python
"""`make demo-agent`'s report: held-out success and the episodes' numbers of a run of recipes/tiny-agent-cpu.yaml
(`tools/demo_agent_report.py RUN_DIR`)."""
from __future__ import annotations

from pathlib import Path

from m2po_megatron.run.metrics import read_metrics

CUSTOM = ("turns", "tool_calls", "used_tool", "tool_call_success")


def summarize(run_dir: str | Path) -> list[str]:
    """`make demo-agent`'s report of a run: held-out success (eval/avg/pass@1, the calculator's episodes) at
    the first and last evaluation, and what the episodes logged (rollout/custom/*) and their reward over the
    first and last five steps."""
    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    evals = [r for r in rows if "eval/avg/pass@1" in r]
    train = [r for r in rows if "reward/mean" in r]
    lines = []
    if evals:
        lines.append(f"held-out success: step {evals[0]['step']}: {evals[0]['eval/avg/pass@1']:.1f}% -> "
                     f"step {evals[-1]['step']}: {evals[-1]['eval/avg/pass@1']:.1f}%  ("
                     + ", ".join(f"{r['step']}: {r['eval/avg/pass@1']:.1f}" for r in evals) + ")")

    def mean(rs, key):
        v = [r[key] for r in rs if key in r]
        return sum(v) / len(v) if v else float("nan")

    if train:
        head, tail = train[:5], train[-5:]
        span = f"steps {head[0]['step']}-{head[-1]['step']} -> {tail[0]['step']}-{tail[-1]['step']}"
        parts = [f"reward {mean(head, 'reward/mean'):.2f} -> {mean(tail, 'reward/mean'):.2f}"]
        parts += [f"{k} {mean(head, 'rollout/custom/' + k):.2f} -> {mean(tail, 'rollout/custom/' + k):.2f}"
                  for k in CUSTOM]
        lines.append(f"episodes ({span}): " + ", ".join(parts))
    return lines


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Print the held-out success and episode numbers of a demo-agent run.")
    ap.add_argument("run_dir")
    args = ap.parse_args(argv)
    for line in summarize(args.run_dir) or [f"no metrics in {args.run_dir}"]:
        print(f"[demo-agent] {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
