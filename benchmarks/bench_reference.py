"""The reference model's cost (issue 50's goal): the KL-to-reference pass as a share of the step, on the CPU.

The protocol is fixed here, before any result:
- The run: the embedded default (recipes/tiny-cpu.yaml, its task built or reused as bench_staleness.py does)
  in on_policy mode (synchronous: the trainer's time is on the step's critical path), train.updates_per_step
  2, evaluation and checkpoints off, `--steps` 10 steps of which the first `--skip` 2 are left out of every
  mean; one trainer rank, one engine. Three configurations, the same seed (the recipe's):
  `base` (no reference), `kl` (algo.use_kl_loss=true, algo.entropy_coeff=0.001, the reference offloaded to
  the host between passes: the default) and `kl_resident` (the same with algo.ref_param_offload=false).
- `--rounds` 2 rounds; the order of the three rotates from round to round, so that the machine's drift does
  not favour one of them.
- Reported, from metrics.jsonl (mean over the kept steps):
  (a) `time/actor/ref_pass` over `time/actor/train_step` and over `time/step`, per run and pooled (the mean of
      the rounds' ratios): the pass's share of the train step and of the whole step;
  (b) the train step and the whole step of `kl` and `kl_resident` over `base`'s, per round and pooled (the
      mean over the rounds of each ratio).
On the CPU the offload copies host memory to host memory, so (a) for `kl` against `kl_resident` shows the
copy's cost here, not over PCIe (plan/costs.py prices that). Nothing is tuned after seeing a result.

    .venv/bin/python benchmarks/bench_reference.py [--steps 10] [--skip 2] [--rounds 2] [--out FILE] [--runs DIR]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_staleness import REPO, run as run_tiny, tiny_task  # noqa: E402

BASE = ["staleness.mode=on_policy"]
KL = [*BASE, "algo.use_kl_loss=true", "algo.entropy_coeff=0.001"]
CONFIGS = {"base": BASE, "kl": KL, "kl_resident": [*KL, "algo.ref_param_offload=false"]}
UPDATES_PER_STEP = 2


def figures(rows: list[dict]) -> dict:
    mean = lambda k: statistics.fmean(r.get(k, 0.0) for r in rows)  # noqa: E731
    return {"step_s": mean("time/step"), "train_step_s": mean("time/actor/train_step"),
            "ref_pass_s": mean("time/actor/ref_pass"),
            "ref_share_of_train_step": statistics.fmean(r.get("time/actor/ref_pass", 0.0) / r["time/actor/train_step"]
                                                        for r in rows),
            "ref_share_of_step": statistics.fmean(r.get("time/actor/ref_pass", 0.0) / r["time/step"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--task-dir", default=str(REPO / ".cache" / "tiny-task"))
    ap.add_argument("--runs", default=None, help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    task = tiny_task(args.task_dir, args.steps, args.skip)
    tmp = Path(args.runs or tempfile.mkdtemp(prefix="m2po-bench-reference-"))
    names = list(CONFIGS)
    rounds: list[dict] = []
    for i in range(args.rounds):
        order = names[i % len(names):] + names[:i % len(names)]
        res: dict = {"order": order}
        for name in order:
            rows = run_tiny(task, tmp, f"r{i}-{name}", args.steps, UPDATES_PER_STEP, CONFIGS[name])[args.skip:]
            res[name] = figures(rows)
            print(f"round {i} {name}:", json.dumps(res[name]), flush=True)
        for name in ("kl", "kl_resident"):
            res[f"{name}/base"] = {k: res[name][k] / res["base"][k] for k in ("step_s", "train_step_s")}
        rounds.append(res)
    pooled = {name: {k: statistics.fmean(r[name][k] for r in rounds)
                     for k in ("ref_share_of_train_step", "ref_share_of_step", "ref_pass_s")}
              for name in ("kl", "kl_resident")}
    for name in ("kl", "kl_resident"):
        pooled[name].update({f"{k}_over_base": statistics.fmean(r[f"{name}/base"][k] for r in rounds)
                             for k in ("step_s", "train_step_s")})
    print("\n| round | order | config | ref pass s | share of train step | share of step | train step / base "
          "| step / base |")
    print("|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rounds):
        for name in ("kl", "kl_resident"):
            f, b = r[name], r[f"{name}/base"]
            print(f"| {i} | {', '.join(r['order'])} | {name} | {f['ref_pass_s']:.3f} | "
                  f"{100 * f['ref_share_of_train_step']:.1f} % | {100 * f['ref_share_of_step']:.1f} % | "
                  f"{b['train_step_s']:.3f} | {b['step_s']:.3f} |")
    for name in ("kl", "kl_resident"):
        p = pooled[name]
        print(f"| pooled | | {name} | {p['ref_pass_s']:.3f} | {100 * p['ref_share_of_train_step']:.1f} % | "
              f"{100 * p['ref_share_of_step']:.1f} % | {p['train_step_s_over_base']:.3f} | "
              f"{p['step_s_over_base']:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"steps": args.steps, "skip": args.skip, "rounds": rounds,
                                              "pooled": pooled}, indent=2))


if __name__ == "__main__":
    main()
