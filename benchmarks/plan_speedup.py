"""The asynchronous speed-up `m2po plan` predicts for a paper recipe (docs/plan.md): the best layout of the
cluster in `on_policy` mode against the best in `bounded` mode at several windows, all disaggregated (trainer
nodes and rollout nodes apart, as this project runs), and the best colocated on-policy layout (every GPU
generates, then every GPU trains: the baseline AReaL and verl report their speed-ups against), which this
project cannot run but the plan prices (plan/colocated.py).

    .venv/bin/python benchmarks/plan_speedup.py [--recipe recipes/paper/qwen3-8b-base.yaml] [--gpus 64] [--gpu h100]
"""
from __future__ import annotations

import argparse

from m2po_megatron.config import load_config
from m2po_megatron.plan.search import plan

ASYNC = ["staleness.lag_steps=0", "staleness.behav_logprob_source=engine"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/paper/qwen3-8b-base.yaml")
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--gpu", default="h100")
    args = ap.parse_args()
    U = load_config(args.recipe, check_files=False).train.updates_per_step
    rows, co = [], None
    for label, mode in [("on_policy", ["staleness.mode=on_policy"])] + [
            (f"bounded, max_staleness {s}", ["staleness.mode=bounded", f"staleness.max_staleness={s}",
                                             f"staleness.sync_interval={U}"]) for s in (U, 2 * U, 4 * U)]:
        res = plan(load_config(args.recipe, [*ASYNC, *mode], check_files=False), args.gpus, gpu=args.gpu, top=3)
        co = co or res["colocated"]  # the on-policy plan's: colocation is synchronous whatever the mode
        c = res["ranked"][0]
        lay = c.layout
        rows.append((label, c.predicted["tokens_per_s"], f"{lay.trainer_gpus} ({lay.tp}x{lay.pp}x{lay.dp})",
                     f"{lay.num_servers} x TP{lay.rollout_tp}", c.predicted))
    base, cot = rows[0][1], co.predicted["tokens_per_s"]
    print(f"{args.recipe} on {args.gpus} x {args.gpu}")
    print("| mode | trainer GPUs | rollout | tokens/s | vs on_policy | vs colocated on-policy | "
          "trainer / rollout idle % | staleness mean |")
    print("|---|---|---|---|---|---|---|---|")
    for label, tps, tr, ro, p in rows:
        print(f"| {label} | {tr} | {ro} | {tps:.0f} | {tps / base:.2f}x | {tps / cot:.2f}x | "
              f"{100 * p['trainer_idle_frac']:.0f}/{100 * p['rollout_idle_frac']:.0f} | {p['staleness_mean']:.1f} |")
    lay = co.layout
    print(f"| colocated on-policy (priced, not run) | all {args.gpus} ({lay.tp}x{lay.pp}x{lay.dp}) | "
          f"{lay.num_servers} x TP{lay.rollout_tp} | {cot:.0f} | {cot / base:.2f}x | 1.00x | | 0 |")


if __name__ == "__main__":
    main()
