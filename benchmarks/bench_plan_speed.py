"""How long `m2po plan` takes: each paper recipe as written at --gpus (default 64) on 8-GPU H100 nodes, the
wall seconds of the whole plan and of its three phases (the ranked search, the colocated layout, the
smallest cluster within --within % of the fastest), with the machine's load average beside each, since the
planner's forked simulations share the cores with whatever else runs. The goal (issue 48): every recipe
within 30 s on an idle 2-core machine.

    .venv/bin/python benchmarks/bench_plan_speed.py [--recipes qwen3-8b-base ...] [--gpus 64] [--out FILE]
"""
from __future__ import annotations

import argparse
import os
import time

from m2po_megatron.config import load_config
from m2po_megatron.plan.search import plan

RECIPES = ["qwen3-1.7b-base", "qwen3-4b-base", "qwen3-8b-base", "qwen2.5-math-7b", "llama-3.2-3b-instruct",
           "qwen2.5-32b", "qwen3-30b-a3b"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=RECIPES)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--within", type=float, default=5.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    head = ("| recipe | GPUs | s (search / colocated / smallest) | load before | rank 1 | tokens/s | tokens/s/GPU | "
            "smallest within | its tokens/s/GPU | simulated / pruned |\n|---|---|---|---|---|---|---|---|---|---|")
    print(f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}\n{head}", flush=True)
    for name in args.recipes:
        cfg = load_config(f"recipes/paper/{name}.yaml", check_files=False)
        load = os.getloadavg()[0]
        t = time.perf_counter()
        res = plan(cfg, args.gpus, within=args.within)
        total = time.perf_counter() - t
        s, c, sm = res["seconds"], res["ranked"][0], res["smallest"]
        lay, sc = c.layout, sm["candidate"]
        per = c.predicted["tokens_per_s"] / (lay.trainer_gpus + lay.rollout_gpus)
        line = (f"| {name} | {args.gpus} | {total:.1f} ({s['search']:.1f} / {s['colocated']:.1f} / "
                f"{s['smallest']:.1f}) | {load:.1f} | {lay.trainer_gpus} ({lay.tp}x{lay.pp}x{lay.dp}), "
                f"{lay.num_servers} x TP{lay.rollout_tp} | {c.predicted['tokens_per_s']:,.0f} | {per:,.0f} | "
                f"{sm['gpus']} GPUs | {sc.predicted['tokens_per_s'] / sm['gpus']:,.0f} | "
                f"{res['simulated']} / {res['pruned']} |")
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
