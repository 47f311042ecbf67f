"""The colocated swap's overhead, and how well `m2po plan RUN_DIR` predicts a colocated run (issue 49's goals).

The protocol is fixed here, before any result:
- The run: the embedded default (recipes/tiny-cpu.yaml, its task built or reused as bench_staleness.py does)
  in fixed_lag mode, staleness.lag_steps 1, train.updates_per_step 2, evaluation and checkpoints off,
  `--steps` 12 steps of which the first `--skip` 3 are left out of every mean; one trainer rank, one engine
  (the recipe's TP1, DP1, rollout.num_servers 1). Two configurations, the same seed (the recipe's):
  disaggregated (the default layout) and colocated (`cluster.colocate=true`).
- `--rounds` 2 rounds; each round runs both configurations, disaggregated first in even rounds and colocated
  first in odd ones, so that the machine's drift does not favour one of them.
- Reported, from metrics.jsonl (mean over the kept steps):
  (a) the swap's overhead: the sum of the `time/colocate/*` phases (release, reload, offload, resume_weights,
      resume_kv) over `time/step`, per colocated run and pooled (the mean of the rounds' ratios), and each
      phase's seconds and share of the step;
  (b) colocated / disaggregated step time, per round and pooled (the mean colocated step over the mean
      disaggregated step);
  (c) `m2po plan RUN_DIR` on each colocated run (calibrated on the run itself, as the command does by default;
      bench_plan.compare computes the same predicted and measured summaries in-process, and the command itself
      is also run once per colocated run to check that it answers): predicted against measured step time,
      the error per round and pooled (the mean prediction over the rounds / the mean measurement - 1).
      Goal: within 15 % pooled. The same prediction of each disaggregated run (calibrated on itself) is
      reported beside it, per round and pooled, so that a miss can be placed in the swap or in the loop.
Nothing is tuned after seeing a result. The machine is shared (2 cores, other work running): the numbers carry
its drift, which the alternating order and the pooling only average.

    .venv/bin/python benchmarks/bench_colocate.py [--steps 12] [--skip 3] [--rounds 2] [--out FILE] [--runs DIR]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_plan import compare, errors, pooled  # noqa: E402
from bench_staleness import REPO, run as run_tiny, tiny_task  # noqa: E402

PHASES = ("release", "reload", "offload", "resume_weights", "resume_kv")
BASE = ["staleness.mode=fixed_lag", "staleness.lag_steps=1"]
CONFIGS = {"disaggregated": BASE, "colocated": [*BASE, "cluster.colocate=true"]}
UPDATES_PER_STEP = 2


def step_figures(rows: list[dict]) -> dict:
    """Mean seconds per kept step of the step, its parts and the swap's phases, and the swap's share."""
    mean = lambda k: statistics.fmean(r.get(k, 0.0) for r in rows)  # noqa: E731
    out = {"step_s": mean("time/step"), "wait_s": mean("time/wait_rollout"), "train_s": mean("time/train"),
           "sync_s": mean("time/weight_sync")}
    if any(f"time/colocate/{p}" in r for r in rows for p in PHASES):
        out["phases_s"] = {p: mean(f"time/colocate/{p}") for p in PHASES}
        out["phase_share"] = {p: statistics.fmean(r.get(f"time/colocate/{p}", 0.0) / r["time/step"] for r in rows)
                              for p in PHASES}
        out["swap_share"] = statistics.fmean(
            sum(r.get(f"time/colocate/{p}", 0.0) for p in PHASES) / r["time/step"] for r in rows)
    return out


def plan_cli(run_dir: Path, skip: int) -> dict:
    """`m2po plan RUN_DIR --format json`'s step-time row: the command as a user runs it."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, "-m", "m2po_megatron.cli", "plan", str(run_dir), "--skip", str(skip),
                        "--format", "json"], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    if p.returncode:
        raise SystemExit(f"m2po plan {run_dir} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout)["summary"]["step_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--task-dir", default=str(REPO / ".cache" / "tiny-task"))
    ap.add_argument("--runs", default=None, help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    from m2po_megatron.plan.calibrate import calibrate

    task = tiny_task(args.task_dir, args.steps, args.skip)
    tmp = Path(args.runs or tempfile.mkdtemp(prefix="m2po-bench-colocate-"))
    rounds: list[dict] = []
    for i in range(args.rounds):
        order = list(CONFIGS) if i % 2 == 0 else list(reversed(CONFIGS))
        res: dict = {"order": order}
        for name in order:
            rows = run_tiny(task, tmp, f"r{i}-{name}", args.steps, UPDATES_PER_STEP, CONFIGS[name])[args.skip:]
            res[name] = step_figures(rows)
            print(f"round {i} {name}:", json.dumps(res[name], default=lambda x: x), flush=True)
        run_dir = tmp / f"r{i}-colocated"
        res["plan"] = errors(compare(run_dir, calibrate(run_dir, skip=args.skip), args.skip))
        res["plan_cli_step_s"] = plan_cli(run_dir, args.skip)
        dis_dir = tmp / f"r{i}-disaggregated"
        res["plan_disaggregated"] = errors(compare(dis_dir, calibrate(dis_dir, skip=args.skip), args.skip))
        res["client_per_sample_s"] = {n: calibrate(tmp / f"r{i}-{n}", skip=args.skip).costs.client_per_sample_s
                                      for n in CONFIGS}
        res["ratio"] = res["colocated"]["step_s"] / res["disaggregated"]["step_s"]
        s = res["plan"]["step_s"]
        print(f"round {i}: swap {100 * res['colocated']['swap_share']:.1f} % of the colocated step; colocated / "
              f"disaggregated step {res['ratio']:.3f}; m2po plan step {s['predicted']:.3f} s predicted / "
              f"{s['measured']:.3f} s measured ({100 * s['rel_error']:+.1f} %); the command said "
              f"{res['plan_cli_step_s']['predicted']:.3f} / {res['plan_cli_step_s']['measured']:.3f}", flush=True)
        rounds.append(res)
    co = [r["colocated"] for r in rounds]
    dis = [r["disaggregated"] for r in rounds]
    plan_pooled = pooled([r["plan"] for r in rounds])
    dis_pooled = pooled([r["plan_disaggregated"] for r in rounds])
    result = {
        "steps": args.steps, "skip": args.skip, "rounds": rounds,
        "pooled": {"swap_share": statistics.fmean(c["swap_share"] for c in co),
                   "phase_share": {p: statistics.fmean(c["phase_share"][p] for c in co) for p in PHASES},
                   "phases_s": {p: statistics.fmean(c["phases_s"][p] for c in co) for p in PHASES},
                   "colocated_step_s": statistics.fmean(c["step_s"] for c in co),
                   "disaggregated_step_s": statistics.fmean(d["step_s"] for d in dis),
                   "plan_step_s": plan_pooled["step_s"], "plan_disaggregated_step_s": dis_pooled["step_s"]}}
    p = result["pooled"]
    p["ratio"] = p["colocated_step_s"] / p["disaggregated_step_s"]
    print("\n| round | order | disaggregated step s | colocated step s | colocated / disaggregated | swap share "
          "| plan step s (pred / meas) | error | disaggregated plan step s (pred / meas) | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rounds):
        s, d = r["plan"]["step_s"], r["plan_disaggregated"]["step_s"]
        print(f"| {i} | {' then '.join(r['order'])} | {r['disaggregated']['step_s']:.3f} | "
              f"{r['colocated']['step_s']:.3f} | {r['ratio']:.3f} | {100 * r['colocated']['swap_share']:.1f} % | "
              f"{s['predicted']:.3f} / {s['measured']:.3f} | {100 * s['rel_error']:+.1f} % | "
              f"{d['predicted']:.3f} / {d['measured']:.3f} | {100 * d['rel_error']:+.1f} % |")
    s, d = p["plan_step_s"], p["plan_disaggregated_step_s"]
    print(f"| pooled | | {p['disaggregated_step_s']:.3f} | {p['colocated_step_s']:.3f} | {p['ratio']:.3f} | "
          f"{100 * p['swap_share']:.1f} % | {s['predicted']:.3f} / {s['measured']:.3f} | "
          f"{100 * s['rel_error']:+.1f} % | {d['predicted']:.3f} / {d['measured']:.3f} | "
          f"{100 * d['rel_error']:+.1f} % |")
    print("client time per sample (ms): " + "; ".join(
        f"round {i} " + ", ".join(f"{n} {1000 * v:.3f}" for n, v in r["client_per_sample_s"].items())
        for i, r in enumerate(rounds)))
    print("\nper phase (pooled): " + ", ".join(f"{ph} {1000 * p['phases_s'][ph]:.1f} ms "
                                               f"({100 * p['phase_share'][ph]:.2f} %)" for ph in PHASES))
    print(f"goal (step time within 15 % pooled): {'met' if abs(s['rel_error']) <= 0.15 else 'missed'}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
