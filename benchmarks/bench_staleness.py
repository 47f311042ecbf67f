"""Asynchronous speed-up on the embedded setup: time per step of `on_policy` against `bounded` with
max_staleness 1 and 4 for the same work, as a ratio to the ideal overlap.

In on_policy mode generation and training alternate, so a step costs gen + train (+ sync). Perfect
overlap would cost max(gen, train). The ideal speed-up is (gen + train) / max(gen, train); the achieved
speed-up is t_step(on_policy) / t_step(bounded); the script reports achieved / ideal (goal >= 0.8).

    .venv/bin/python benchmarks/bench_staleness.py [--updates-per-step 1 2] [--steps 8] [--skip 3]
        [--task-dir .cache/tiny-task] [--out FILE]

Each value of `--updates-per-step` (train.updates_per_step, U) runs the three modes; the defaults give every
row of the table in docs/training.md. Warm-up steps (the first `--skip`) are left out of the means: they
include start-up and compile effects. With U = 1, max_staleness 1 allows one step of overlap; with U
updates per step a window below U cannot overlap anything (a group would have to be trained by the step
already running), which the U = 2 rows show.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tiny_task(task_dir: str, steps: int, skip: int) -> Path:
    """The tiny task at `task_dir` (built there when absent), once --skip is checked against --steps."""
    if skip >= steps:
        raise SystemExit(f"--skip {skip} leaves none of the --steps {steps} steps to measure")
    task = Path(task_dir)
    if not (task / "build_info.json").exists():
        from m2po_megatron.demo.tiny_model import build_tiny_task

        build_tiny_task(task, seed=0)
    return task


def run(task: Path, out: Path, name: str, steps: int, updates_per_step: int, extra: list[str]) -> list[dict]:
    args = [f"model.hf_path={task}", f"data.train_path={task / 'train.jsonl'}", "data.eval_paths=[]",
            f"run.output_dir={out}", f"run.name={name}", f"train.steps={steps}", "checkpoint.interval=0",
            "eval.interval=0", f"train.updates_per_step={updates_per_step}", *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled", WANDB_MODE="disabled")
    p = subprocess.run([sys.executable, "-m", "m2po_megatron.cli", "train", "tiny-cpu", *args], env=env,
                       capture_output=True, text=True, cwd=REPO)
    if p.returncode:
        raise SystemExit(f"{name} failed:\n{p.stderr[-4000:]}")
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()
            if line.strip() and "samples/generated" in line]


MODES = {"on_policy": ["staleness.mode=on_policy"],
         "bounded_s1": ["staleness.mode=bounded", "staleness.max_staleness=1", "staleness.sync_interval=1"],
         "bounded_s4": ["staleness.mode=bounded", "staleness.max_staleness=4", "staleness.sync_interval=2"]}
LABELS = {"on_policy": "on_policy", "bounded_s1": "bounded, max_staleness 1", "bounded_s4": "bounded, max_staleness 4"}


def measure(task: Path, tmp: Path, steps: int, skip: int, updates_per_step: int) -> dict:
    """The three modes at one updates_per_step; speed-ups against this run's on_policy."""
    res: dict = {}
    for name, extra in MODES.items():
        rows = run(task, tmp, f"u{updates_per_step}-{name}", steps, updates_per_step, extra)[skip:]
        mean = lambda k: statistics.fmean(r.get(k, 0.0) for r in rows)  # noqa: E731
        res[name] = {"step_s": mean("time/step"), "wait_rollout_s": mean("time/wait_rollout"),
                     "train_s": mean("time/train"), "sync_s": mean("time/weight_sync"),
                     "staleness_mean": mean("staleness/mean")}
        print(f"U={updates_per_step}", name, json.dumps({k: round(v, 3) for k, v in res[name].items()}), flush=True)
    base = res["on_policy"]
    gen, train = base["wait_rollout_s"], base["train_s"] + base["sync_s"]
    ideal = (gen + train) / max(gen, train)
    for name in ("bounded_s1", "bounded_s4"):
        achieved = base["step_s"] / res[name]["step_s"]
        res[name]["speedup"] = achieved
        res[name]["speedup_over_ideal"] = achieved / ideal
        print(f"U={updates_per_step} {name}: speed-up {achieved:.2f}x vs on_policy; ideal {ideal:.2f}x; "
              f"ratio to ideal {achieved / ideal:.2f} (goal >= 0.8)", flush=True)
    res["ideal_speedup"] = ideal
    return res


def table_rows(updates_per_step: int, res: dict) -> list[str]:
    """The rows of docs/training.md's table for one updates_per_step."""
    out = []
    for name in MODES:
        r = res[name]
        speed = "1.00" if name == "on_policy" else f"{r['speedup']:.2f}x"
        ratio = "" if name == "on_policy" else f"{r['speedup_over_ideal']:.2f}"
        if name == "bounded_s1":
            ratio += f" (ideal {res['ideal_speedup']:.2f}x)"
        out.append(f"| {updates_per_step} | {LABELS[name]} | {r['step_s']:.2f} | {r['wait_rollout_s']:.2f} | "
                   f"{r['train_s']:.2f} | {r['staleness_mean']:.1f} | {speed} | {ratio} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--updates-per-step", type=int, nargs="+", default=[1, 2],
                    help="train.updates_per_step values to run (each runs the three modes)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=3, help="first steps left out of the means")
    ap.add_argument("--task-dir", default=str(REPO / ".cache" / "tiny-task"))
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    task = tiny_task(args.task_dir, args.steps, args.skip)
    tmp = Path(tempfile.mkdtemp(prefix="m2po-bench-stale-"))
    res = {str(u): measure(task, tmp, args.steps, args.skip, u) for u in args.updates_per_step}
    print("\n".join(row for u in args.updates_per_step for row in table_rows(u, res[str(u)])))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
