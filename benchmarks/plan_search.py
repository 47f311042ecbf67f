"""The search of `m2po plan` against brute force (issue 36's goal): for each paper recipe and cluster size,
the pruned search's #1 next to the best of every layout simulated (`exhaustive`), on the same seeds, so a
layout's prediction is the same in both. A row passes when the search's #1 is within 2 % of brute force's
best or declared not separable from it (plan/search.py `separable`).

    .venv/bin/python benchmarks/plan_search.py [--recipes qwen3-8b-base ...] [--gpus 16 32 64 128] [--out FILE]

Rows are printed (and appended to --out) as each finishes, smallest clusters first."""
from __future__ import annotations

import argparse
import time

from m2po_megatron.config import load_config
from m2po_megatron.plan.search import plan, separable

RECIPES = ["qwen3-1.7b-base", "qwen3-4b-base", "qwen3-8b-base", "qwen2.5-math-7b", "llama-3.2-3b-instruct",
           "qwen2.5-32b"]


def _name(c) -> str:
    lay = c.layout
    si = c.overrides.get("staleness.sync_interval")
    return f"{lay.trainer_gpus} ({lay.tp}x{lay.pp}x{lay.dp}), {lay.num_servers} x TP{lay.rollout_tp}" + (
        f", sync {si}" if si else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=RECIPES)
    ap.add_argument("--gpus", nargs="+", type=int, default=[16, 32, 64, 128])
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*", help="dotted overrides for every recipe (e.g. staleness.mode=bounded)")
    args = ap.parse_args()
    head = ("| recipe | GPUs | search #1 | tokens/s | brute-force best | tokens/s | #1 vs best | not separable | "
            "simulated (search / brute) | s (search / brute) | pass |\n|---|---|---|---|---|---|---|---|---|---|---|")
    print(head, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"{' '.join(args.overrides)}\n{head}\n")
    for gpus in args.gpus:
        for recipe in args.recipes:
            cfg = load_config(f"recipes/paper/{recipe}.yaml", args.overrides, check_files=False)
            t0 = time.time()
            fast = plan(cfg, gpus, top=3)
            t1 = time.time()
            brute = plan(cfg, gpus, top=3, exhaustive=True)
            t2 = time.time()
            if not fast["ranked"]:
                row = f"| {recipe} | {gpus} | no layout fits | | | | | | | | |"
            else:
                first = fast["ranked"][0]
                best = max(brute["all"], key=lambda c: c.predicted["tokens_per_s"])
                gap = first.predicted["tokens_per_s"] / best.predicted["tokens_per_s"] - 1
                tied = not separable(best.predicted, first.predicted)
                row = (f"| {recipe} | {gpus} | {_name(first)} | {first.predicted['tokens_per_s']:,.0f} | {_name(best)} | "
                       f"{best.predicted['tokens_per_s']:,.0f} | {100 * gap:+.1f} % | {'yes' if tied else 'no'} | "
                       f"{fast['simulated']} / {brute['simulated']} | {t1 - t0:.0f} / {t2 - t1:.0f} | "
                       f"{'yes' if gap >= -0.02 or tied else 'NO'} |")
            print(row, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(row + "\n")


if __name__ == "__main__":
    main()
