"""The asynchronous speed-up `m2po plan` predicts for a paper recipe (docs/plan.md): the best layout of the
cluster in `on_policy` mode against the best in `bounded` mode at several windows, all disaggregated (trainer
nodes and rollout nodes apart, as this project runs), and a synchronous colocated estimate (every GPU generates,
then every GPU trains: the baseline AReaL and verl report their speed-ups against), which this project cannot
run but the same cost model can price.

    .venv/bin/python benchmarks/plan_speedup.py [--recipe recipes/paper/qwen3-8b-base.yaml] [--gpus 64] [--gpu h100]
"""
from __future__ import annotations

import argparse

from m2po_megatron.config import load_config, model_hf_config
from m2po_megatron.models.memory import model_shape, param_count
from m2po_megatron.plan.costs import Layout, from_hardware
from m2po_megatron.plan.search import plan, spec_from_config
from m2po_megatron.plan.sim import simulate

ASYNC = ["staleness.lag_steps=0", "staleness.behav_logprob_source=engine"]


def colocated(recipe: str, gpus: int, gpu: str) -> tuple[float, int]:
    """Best tokens/s (and its rollout TP) when all GPUs generate and then all train, weights synced in place."""
    cfg = load_config(recipe, [*ASYNC, "staleness.mode=on_policy"], check_files=False)
    hf = model_hf_config(cfg)
    shape, n = model_shape(hf), param_count(hf)
    best = (0.0, 0)
    for rtp in (1, 2, 4, 8):
        lay = Layout(tp=cfg.parallel.tensor_model_parallel_size, pp=1,
                     dp=gpus // cfg.parallel.tensor_model_parallel_size, rollout_tp=rtp, num_servers=gpus // rtp)
        sp = spec_from_config(cfg, num_servers=lay.num_servers)
        c = from_hardware(shape, n, lay, gpu, micro_batches=4, mean_context=sp.prompt_len + sp.response.mean,
                          mem_fraction_static=cfg.rollout.mem_fraction_static, same_node_sync=True,
                          fp8=bool(cfg.model.fp8), use_distributed_optimizer=cfg.parallel.use_distributed_optimizer)
        # on_policy: the first step fills nothing, so it is left out; eight in the steady state
        best = max(best, (simulate(sp, c, steps=9, seed=0, skip=1).summary()["tokens_per_s"], rtp))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/paper/qwen3-8b-base.yaml")
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--gpu", default="h100")
    args = ap.parse_args()
    U = load_config(args.recipe, check_files=False).train.updates_per_step
    rows = []
    for label, mode in [("on_policy", ["staleness.mode=on_policy"])] + [
            (f"bounded, max_staleness {s}", ["staleness.mode=bounded", f"staleness.max_staleness={s}",
                                             f"staleness.sync_interval={U}"]) for s in (U, 2 * U, 4 * U)]:
        res = plan(load_config(args.recipe, [*ASYNC, *mode], check_files=False), args.gpus, gpu=args.gpu)
        c = res["ranked"][0]
        lay = c.layout
        rows.append((label, c.predicted["tokens_per_s"], f"{lay.trainer_gpus} ({lay.tp}x{lay.pp}x{lay.dp})",
                     f"{lay.num_servers} x TP{lay.rollout_tp}", c.predicted))
    base = rows[0][1]
    co, rtp = colocated(args.recipe, args.gpus, args.gpu)
    print(f"{args.recipe} on {args.gpus} x {args.gpu}")
    print("| mode | trainer GPUs | rollout | tokens/s | vs on_policy | vs colocated sync | idle T/R % | "
          "staleness mean |")
    print("|---|---|---|---|---|---|---|---|")
    for label, tps, tr, ro, p in rows:
        print(f"| {label} | {tr} | {ro} | {tps:.0f} | {tps / base:.2f}x | {tps / co:.2f}x | "
              f"{100 * p['trainer_idle_frac']:.0f}/{100 * p['rollout_idle_frac']:.0f} | {p['staleness_mean']:.1f} |")
    print(f"| synchronous colocated (estimate) | all {args.gpus} | {args.gpus // rtp} x TP{rtp} | {co:.0f} | "
          f"{co / base:.2f}x | 1.00x | | 0 |")


if __name__ == "__main__":
    main()
