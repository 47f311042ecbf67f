"""Asynchronous speed-up on the embedded setup: time per step of `on_policy` against `bounded` with
max_staleness 1 and 4 for the same work, as a ratio to the ideal overlap.

In on_policy mode generation and training alternate, so a step costs gen + train (+ sync). Perfect
overlap would cost max(gen, train). The ideal speed-up is (gen + train) / max(gen, train); the achieved
speed-up is t_step(on_policy) / t_step(bounded); the script reports achieved / ideal (goal >= 0.8).

    .venv/bin/python benchmarks/bench_staleness.py --steps 6 [--task-dir .cache/tiny-task] [--out FILE]

Warm-up steps (the first `--skip`) are left out of the means: they include start-up and compile effects.
One optimizer update per step, so max_staleness 1 allows one step of overlap (with U updates per step a
window below U cannot overlap anything: a group would have to be trained by the step already running).
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


def run(task: Path, out: Path, name: str, steps: int, extra: list[str]) -> list[dict]:
    args = [f"model.hf_path={task}", f"data.train_path={task / 'train.jsonl'}", "data.eval_paths=[]",
            f"run.output_dir={out}", f"run.name={name}", f"train.steps={steps}", "checkpoint.interval=0",
            "eval.interval=0", "train.updates_per_step=1", *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled", WANDB_MODE="disabled")
    p = subprocess.run([sys.executable, "-m", "m2po_megatron.cli", "train", "tiny-cpu", *args], env=env,
                       capture_output=True, text=True, cwd=REPO)
    if p.returncode:
        raise SystemExit(f"{name} failed:\n{p.stderr[-4000:]}")
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()
            if line.strip() and "samples/generated" in line]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the means")
    ap.add_argument("--task-dir", default=str(REPO / ".cache" / "tiny-task"))
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    task = Path(args.task_dir)
    if not (task / "build_info.json").exists():
        from m2po_megatron.demo.tiny_model import build_tiny_task

        build_tiny_task(task, seed=0)
    tmp = Path(tempfile.mkdtemp(prefix="m2po-bench-stale-"))

    modes = {"on_policy": ["staleness.mode=on_policy"],
             "bounded_s1": ["staleness.mode=bounded", "staleness.max_staleness=1", "staleness.sync_interval=1"],
             "bounded_s4": ["staleness.mode=bounded", "staleness.max_staleness=4", "staleness.sync_interval=2"]}
    res = {}
    for name, extra in modes.items():
        rows = run(task, tmp, name, args.steps, extra)[args.skip:]
        mean = lambda k: statistics.fmean(r.get(k, 0.0) for r in rows)  # noqa: E731
        res[name] = {"step_s": mean("time/step"), "wait_rollout_s": mean("time/wait_rollout"),
                     "train_s": mean("time/train"), "sync_s": mean("time/weight_sync"),
                     "staleness_mean": mean("staleness/mean")}
        print(name, json.dumps({k: round(v, 3) for k, v in res[name].items()}), flush=True)

    base = res["on_policy"]
    gen, train = base["wait_rollout_s"], base["train_s"] + base["sync_s"]
    ideal = (gen + train) / max(gen, train)
    for name in ("bounded_s1", "bounded_s4"):
        achieved = base["step_s"] / res[name]["step_s"]
        res[name]["speedup"] = achieved
        res[name]["speedup_over_ideal"] = achieved / ideal
        print(f"{name}: speed-up {achieved:.2f}x vs on_policy; ideal {ideal:.2f}x; "
              f"ratio to ideal {achieved / ideal:.2f} (goal >= 0.8)")
    res["ideal_speedup"] = ideal
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
