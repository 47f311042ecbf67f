"""`m2po plan`: size a cluster for a recipe from a simulation of the asynchronous loop (docs/plan.md).

    m2po plan RECIPE --gpus 64 [--gpus-per-node 8] [--gpu h100] [--out overrides.yaml] [--format json] [k=v ...]
    m2po plan --calibrate RUN_DIR [--gpu h100] [--out calibration.json]
    m2po plan RUN_DIR [--calibration calibration.json]

The first enumerates the trainer/rollout splits and layouts that pass the config's validation and fit the memory
estimate, simulates them over several seeds (plan/sim.py drives the project's own generators and staleness
controller on a simulated clock), pruning only those whose upper bound is below the shown ones (plan/bound.py),
and prints them ranked by predicted trained tokens per second, mean and spread; --out writes the best as
dotted overrides. The second fits the cost model on a finished run's timeline and metrics
(plan/calibrate.py); with --gpu the fit is also expressed as efficiencies of that GPU, which the first form
takes with --calibration. The third puts what the simulation predicts for a finished run next to what the
run measured (calibrated on the run itself unless --calibration names another)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

_SUMMARY = ("step_s", "wait_s", "train_s", "sync_s", "tokens_per_s", "steps_per_hour", "staleness_mean",
            "staleness_max")


def register(sub) -> None:
    p = sub.add_parser("plan", help="size a cluster for a recipe from a simulation (and calibrate it on a run)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", nargs="?", default=None, metavar="RECIPE|RUN_DIR",
                   help="a recipe (a path or a name under recipes/) to plan, or a finished run to predict")
    p.add_argument("overrides", nargs="*", help="dotted overrides for the recipe, e.g. train.prompts_per_step=64")
    p.add_argument("--gpus", type=int, default=None, help="GPUs in the cluster (whole nodes past one node)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", default=None, choices=("h100", "h200", "a100"),
                   help="the GPU (default h100 for a plan; for --calibrate: the GPU the run used, if any)")
    p.add_argument("--top", type=int, default=8, help="distinct layouts to show (default 8)")
    p.add_argument("--seeds", type=int, default=3, help="simulations per layout, each with its own lengths "
                                                        "(default 3)")
    p.add_argument("--within", type=float, default=None, metavar="PERCENT",
                   help="also show the smallest cluster (fewer GPUs than --gpus) whose best layout is within this "
                        "many percent of the fastest's tokens/s (default 5)")
    p.add_argument("--exhaustive", action="store_true",
                   help="simulate every layout, pruning none (the brute force the search is tested against)")
    p.add_argument("--format", default="table", choices=("table", "json"))
    p.add_argument("--out", default=None,
                   help="a plan: write the best layout as recipe overrides (YAML); --calibrate: the fit (JSON)")
    p.add_argument("--colocated-out", default=None, metavar="FILE",
                   help="a plan: write the best colocated layout (cluster.colocate) as recipe overrides (YAML)")
    p.add_argument("--calibrate", default=None, metavar="RUN_DIR", help="fit the cost model on this run")
    p.add_argument("--calibration", default=None, metavar="FILE", help="a fit written by --calibrate --out")
    p.add_argument("--mfu", type=float, default=None,
                   help="the trainer's model FLOPs utilisation, measured on your GPUs (training tokens/s x 6 x "
                        "parameters / peak FLOPs; benchmarks/gpu_check.py prints tokens/s) or the default 0.35 "
                        "(or the calibration's)")
    p.add_argument("--skip", type=int, default=3, help="a run's first steps left out (start-up; default 3)")
    p.add_argument("--steps", type=int, default=None,
                   help="a plan: steps measured per simulation after the warm-up (default 8); a run's prediction: "
                        "steps to simulate (default: enough to fill the window)")
    p.set_defaults(func=run)


def _is_run_dir(path: str) -> bool:
    d = Path(path)
    return d.is_dir() and (d / "config.yaml").is_file() and (d / "metrics.jsonl").is_file()


def _fail(msg: str) -> int:
    print(f"m2po plan: {msg}", file=sys.stderr)
    return 2


def run(args) -> int:
    from m2po_megatron.config import ConfigError

    try:
        if args.calibrate:
            return _calibrate(args)
        if args.target is None:
            return _fail("give a RECIPE with --gpus N, a RUN_DIR, or --calibrate RUN_DIR (see --help)")
        if _is_run_dir(args.target):
            return _predict_run(args)
        return _plan(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        if isinstance(e, ConfigError):
            raise
        return _fail(str(e))
    except (KeyError, TypeError, IndexError) as e:  # a trace.json or metrics.jsonl that m2po did not write
        return _fail(f"{args.calibrate or args.target}: its timeline or metrics lack what a run writes ({e!r}); "
                     "calibrate on a run of this version (trace.json with engine and trainer spans, metrics.jsonl)")


def _load_calibration(path: str):
    from m2po_megatron.plan.calibrate import Calibration

    try:
        return Calibration.from_dict(json.loads(Path(path).read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--calibration {path}: cannot read it ({e}); write one with "
                         "`m2po plan --calibrate RUN_DIR --out FILE`") from None


def _calibrate(args) -> int:
    from m2po_megatron.plan.calibrate import calibrate

    if not _is_run_dir(args.calibrate):
        return _fail(f"--calibrate {args.calibrate}: not a run directory (config.yaml and metrics.jsonl)")
    cal = calibrate(args.calibrate, skip=args.skip)
    if args.gpu:
        cal.fit["efficiency"] = _efficiency(cal, args.gpu)
    doc = cal.to_dict()
    text = json.dumps(doc, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.format == "json":
        print(text)
    else:
        c = doc["costs"]
        print(f"calibrated on {args.calibrate} ({cal.fit['steps']} steps after {args.skip}; "
              f"{cal.fit['decode_spans']} decode spans)")
        for k in ("train_fixed_s", "train_per_update_s", "train_per_token_s", "logprob_per_token_s",
                  "decode_fixed_s", "decode_per_seq_s", "decode_per_kv_s", "prefill_per_token_s", "sync_fixed_s",
                  "loop_fixed_s", "client_per_sample_s", "shared_cores", "contention"):
            print(f"  {k:22s} {c[k]:.4g}")
        print(f"  responses: mean {cal.response.mean:.1f} tokens, cv {cal.response.cv:.2f}, max "
              f"{cal.response.max}; prompts {cal.prompt_len:.1f} tokens")
        co = cal.fit.get("colocate")
        if co:
            from m2po_megatron.plan.calibrate import COLOCATE_PHASES

            print("  colocated swap per step: " + ", ".join(f"{k} {co[k]:.3g} s" for k in COLOCATE_PHASES)
                  + f"; {co['swap_s']:.3g} s in all ({co['in_wait_s']:.3g} s of it inside the wait, added to "
                  "loop_fixed_s)")
        if "efficiency" in cal.fit:
            print("  efficiencies on " + args.gpu + ": "
                  + ", ".join(f"{k} {v:.3g}" for k, v in cal.fit["efficiency"].items()))
        if args.out:
            print(f"written to {args.out}")
    return 0


def _efficiency(cal, gpu: str) -> dict:
    """The fit as efficiencies of `gpu`, at the calibration run's own layout."""
    from m2po_megatron.config import load_config, model_hf_config
    from m2po_megatron.models.memory import model_shape, param_count
    from m2po_megatron.plan.costs import Layout, efficiency_of

    cfg = load_config(Path(cal.run_dir) / "config.yaml", check_files=False)
    hf = model_hf_config(cfg)
    p, r = cfg.parallel, cfg.rollout
    lay = Layout(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size, r.tp_size,
                 r.num_servers)
    ctx = cal.prompt_len + cal.response.mean
    tokens_update = cfg.train.prompts_per_step * r.n_samples_per_prompt * ctx / cfg.train.updates_per_step
    mbs = max(1, round(tokens_update / lay.dp / cfg.train.micro_batch_tokens))
    eff = efficiency_of(cal.costs, model_shape(hf), param_count(hf), lay, gpu, micro_batches=mbs,
                        mean_context=ctx, has_engine=cal.fit.get("decode_spans", 0) > 0, fp8=bool(cfg.model.fp8),
                        gpus_per_node=cfg.cluster.gpus_per_node,
                        use_distributed_optimizer=p.use_distributed_optimizer)
    return {**eff, **colocate_efficiency(cal, cfg, hf, gpu)}


def colocate_efficiency(cal, cfg, hf: dict, gpu: str) -> dict:
    """A colocated run's swap as the terms plan/colocated.swap_s prices: the host link's efficiency (the
    trainer's weights, gradients and optimizer states to the host and back in the measured offload and reload
    seconds) and the engine's release and resume seconds per step. Empty for a disaggregated run."""
    from m2po_megatron.config import estimate_memory
    from m2po_megatron.plan.hardware import GPUS

    co = cal.fit.get("colocate")
    if not co:
        return {}
    out = {"swap_fixed_s": co["release"] + co["resume_weights"] + co["resume_kv"]}
    est = estimate_memory(cfg, hf)
    moved = co["reload"] + co["offload"]
    if est and moved > 0:
        state = (est["weights"] + est["grads"] + est["optimizer"]) * 2**30
        out["host_link"] = 2 * state / (GPUS[gpu].pcie_gb_s * 1e9 * moved)
    return out


def summary_error(key: str, predicted: float, measured: float, step_s: float) -> Optional[float]:
    """Staleness: predicted - measured, in updates. Otherwise predicted / measured - 1, except for a part of
    the step (wait_s, train_s, sync_s) that measured under 1 % of the step: None, since its relative error is
    noise (a run that never waits measures a few tenths of a millisecond of wait)."""
    if key.startswith("staleness"):
        return predicted - measured
    if key in ("wait_s", "train_s", "sync_s") and abs(measured) < 0.01 * step_s:
        return None
    return predicted / measured - 1 if measured else None


def _predict_run(args) -> int:
    from m2po_megatron.config import load_config
    from m2po_megatron.plan.calibrate import calibrate, measured, predict

    cal = _load_calibration(args.calibration) if args.calibration else calibrate(args.target, skip=args.skip)
    cfg = load_config(Path(args.target) / "config.yaml", check_files=False)
    got = measured(args.target, skip=args.skip)
    pred = predict(cfg, cal, steps=args.steps, skip=args.skip)
    rows = {k: {"predicted": pred[k], "measured": got[k], "error": summary_error(k, pred[k], got[k], got["step_s"])}
            for k in _SUMMARY}
    doc = {"run_dir": args.target, "calibrated_on": cal.run_dir, "summary": rows,
           "predicted_idle": {"trainer": pred["trainer_idle_frac"], "rollout": pred["rollout_idle_frac"]}}
    if args.format == "json":
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{args.target}: predicted (calibrated on {cal.run_dir}) against measured, after step {args.skip}")
    print(f"  {'':16s} {'predicted':>10s} {'measured':>10s} {'error':>8s}")
    for k, r in rows.items():
        err = "" if r["error"] is None else (f"{r['error']:+.2f}" if k.startswith("staleness")
                                             else f"{100 * r['error']:+.1f} %")
        print(f"  {k:16s} {r['predicted']:10.3f} {r['measured']:10.3f} {err:>8s}")
    print(f"  predicted idle, as a share of the measured steps' time: the trainer waiting for a batch "
          f"{100 * pred['trainer_idle_frac']:.1f} %, a rollout server decoding nothing "
          f"{100 * pred['rollout_idle_frac']:.1f} %")
    return 0


def _plan(args) -> int:
    from m2po_megatron.config import load_config
    from m2po_megatron.plan.search import plan

    if args.gpus is None:
        return _fail(f"{args.target}: give the cluster's size with --gpus N (a recipe is planned for a cluster)")
    cfg = load_config(args.target, list(args.overrides), check_files=False)
    efficiency = None
    if args.calibration:
        cal = _load_calibration(args.calibration)
        efficiency = cal.fit.get("efficiency")
        if not efficiency:
            return _fail(f"--calibration {args.calibration} has no GPU efficiencies (a CPU run, or calibrated "
                         "without --gpu); calibrate a GPU run with `m2po plan --calibrate RUN_DIR --gpu GPU`")
    if args.mfu is not None:
        if not 0 < args.mfu <= 1:
            return _fail(f"--mfu {args.mfu}: give a fraction in (0, 1], e.g. 0.35")
        efficiency = {**(efficiency or {}), "mfu": args.mfu}
    gpu = args.gpu or "h100"
    if args.top < 1:
        return _fail(f"--top {args.top}: give at least 1")
    from m2po_megatron.plan.search import WITHIN

    within = WITHIN if args.within is None else args.within
    if not 0 <= within < 100:
        return _fail(f"--within {within}: give a percentage in [0, 100), e.g. 5")
    res = plan(cfg, args.gpus, args.gpus_per_node, gpu, steps=args.steps, seeds=args.seeds, top=args.top,
               efficiency=efficiency, exhaustive=args.exhaustive, within=within)
    ranked = res["ranked"]
    if not ranked:
        return _fail(f"no layout of {args.gpus} x {gpu} fits this recipe ({res['layouts']} tried, "
                     f"{res['over_memory']} over the memory estimate; {res['skipped']}); add GPUs or lower "
                     "train.micro_batch_tokens")
    if args.out:
        _write_overrides(args.out, ranked[0], args.target, list(args.overrides), args.gpus, gpu)
    if args.colocated_out:
        if res["colocated"] is None:
            return _fail(f"--colocated-out {args.colocated_out}: no colocated layout of {args.gpus} x {gpu} fits "
                         "both phases and passes validation (see the plan without it); add GPUs or lower "
                         "train.micro_batch_tokens")
        _write_overrides(args.colocated_out, res["colocated"], args.target, list(args.overrides), args.gpus, gpu)
    if args.format == "json":
        print(json.dumps({"recipe": args.target, "gpus": args.gpus, "gpu": gpu,
                          **{k: res[k] for k in ("layouts", "over_memory", "skipped", "classes", "simulated",
                                                 "pruned", "seconds")},
                          "ranked": [{"layout": vars(c.layout), "overrides": c.overrides,
                                      "memory_gb": c.memory_gb, "predicted": c.predicted,
                                      "gpus": c.layout.trainer_gpus + c.layout.rollout_gpus,
                                      "tokens_per_s_per_gpu": per_gpu(c),
                                      "equivalent": [vars(e.layout) for e in c.equivalent]} for c in ranked],
                          "smallest": None if res["smallest"] is None else {
                              "gpus": res["smallest"]["gpus"], "within_percent": res["smallest"]["within"],
                              "layout": vars(res["smallest"]["candidate"].layout),
                              "overrides": res["smallest"]["candidate"].overrides,
                              "predicted": res["smallest"]["candidate"].predicted,
                              "tokens_per_s_per_gpu": per_gpu(res["smallest"]["candidate"])},
                          "colocated": None if res["colocated"] is None else {
                              "layout": vars(res["colocated"].layout), "overrides": res["colocated"].overrides,
                              "memory_gb": res["colocated"].memory_gb, "predicted": res["colocated"].predicted}},
                         indent=2))
        return 0
    print(format_plan(res, args.target, args.gpus, gpu))
    if args.out:
        print(f"the best layout written to {args.out}; it extends the recipe: `m2po train {args.out}`")
    if args.colocated_out:
        print(f"the best colocated layout written to {args.colocated_out}: `m2po train {args.colocated_out}`")
    return 0


def per_gpu(c, gpus: Optional[int] = None) -> float:
    """Predicted tokens/s per GPU held (what a user pays for): over the trainer's and the servers' GPUs, or
    `gpus` (a colocated layout's trainer and servers share theirs)."""
    return c.predicted["tokens_per_s"] / (gpus or c.layout.trainer_gpus + c.layout.rollout_gpus)


IDLE_NOTE = ("trainer idle %: the share of each measured step (after the warm-up) that the trainer GPUs wait for "
             "rollouts (not training, not recomputing log-probs, not pushing weights); rollout idle %: the share "
             "of the same time a rollout server decodes nothing (waiting for the trainer, paused for a weight "
             "push, or out of requests), the mean over servers")


def format_plan(res: dict, recipe: str, gpus: int, gpu: str) -> str:
    head = (f"{recipe} on {gpus} x {gpu}: {res['layouts']} layouts, {res['over_memory']} over memory, "
            f"{sum(res['skipped'].values())} refused by validation; {res['classes']} distinct predictions, "
            f"{res['simulated']} simulated, {res['pruned']} pruned by their upper bound")
    cols = ("rank", "train GPUs", "TPxPPxDP", "rollout", "sync int", "tokens/s (sd)", "mem GiB/GPU", "tokens/s/GPU",
            "steps/h", "trainer idle %", "rollout idle %", "stale mean/max", "sync s")
    lines = [head, " | ".join(cols), " | ".join("-" * len(c) for c in cols)]
    for i, c in enumerate(res["ranked"], 1):
        lay, p = c.layout, c.predicted
        same = f" (+{len(c.equivalent)})" if c.equivalent else ""
        lines.append(" | ".join([
            f"{i}{'~' if p.get('tied_with_best') else ''}", str(lay.trainer_gpus),
            f"{lay.tp}x{lay.pp}x{lay.dp}{same}", f"{lay.num_servers} x TP{lay.rollout_tp}",
            str(c.overrides.get("staleness.sync_interval", "-")),
            f"{p['tokens_per_s']:.0f} ({p['tokens_per_s_sd']:.0f})", f"{c.memory_gb:.1f}", f"{per_gpu(c):.0f}",
            f"{p['steps_per_hour']:.1f}", f"{100 * p['trainer_idle_frac']:.0f}", f"{100 * p['rollout_idle_frac']:.0f}",
            f"{p['staleness_mean']:.1f}/{p['staleness_max']}", f"{p['sync_s']:.1f}"]))
    ties = [i for i, c in enumerate(res["ranked"], 1) if c.predicted.get("tied_with_best")]
    if ties:
        lines.append(f"~ ranks {', '.join(map(str, ties))} are not separable from the best: ranked by memory, least "
                     "first")
    lines += smallest_lines(res, gpus)
    lines += colocated_lines(res)
    for i, c in enumerate(res["ranked"], 1):
        if c.equivalent:
            lines.append(f"rank {i} (+{len(c.equivalent)}): the same within the model's resolution with trainer "
                         + ", ".join(f"{e.layout.tp}x{e.layout.pp}x{e.layout.dp} ({e.memory_gb:.1f} GiB)"
                                     for e in c.equivalent))
    n = len(res["ranked"][0].predicted["tokens_per_s_seeds"]) if res["ranked"] else 0
    lines.append(f"tokens/s: the mean over {n} simulations with their own response lengths, (sd) their standard "
                 "deviation; two layouts are not separable when their throughputs differ by less than 1 % or "
                 "than two standard errors of their seed-by-seed difference; mem GiB/GPU: "
                 "the trainer's memory estimate per GPU (models/memory.py); tokens/s/GPU: over every GPU of the "
                 f"layout, trainer's and servers'; {IDLE_NOTE}")
    for reason, k in res["skipped"].items():
        lines.append(f"refused by validation ({k} layouts): {reason}")
    return "\n".join(lines)


def smallest_lines(res: dict, gpus: int) -> list[str]:
    """The smallest cluster within --within % of rank 1 (plan/search.smallest), beside it."""
    sm = res.get("smallest")
    if sm is None or not res["ranked"]:
        return []
    c, best = sm["candidate"], res["ranked"][0]
    if sm["gpus"] == gpus:
        return [f"smallest within {sm['within']:g} % of rank 1: all {gpus} GPUs (no smaller cluster of the "
                f"{sm['sizes']} sizes searched, 2 to {gpus - 1} GPUs, reaches {sm['target_tokens_per_s']:.0f} "
                "tokens/s)"]
    lay, p = c.layout, c.predicted
    ratio = p["tokens_per_s"] / best.predicted["tokens_per_s"]
    return [f"smallest within {sm['within']:g} % of rank 1: {sm['gpus']} GPUs, trainer {lay.trainer_gpus} "
            f"({lay.tp}x{lay.pp}x{lay.dp}) and {lay.num_servers} x TP{lay.rollout_tp}"
            + (f", sync {c.overrides['staleness.sync_interval']}" if "staleness.sync_interval" in c.overrides else "")
            + f": {p['tokens_per_s']:.0f} ({p['tokens_per_s_sd']:.0f}) tokens/s, {ratio:.2f}x rank 1 on "
            f"{sm['gpus'] / gpus:.2f}x its GPUs, {per_gpu(c):.0f} tokens/s/GPU against {per_gpu(best):.0f}; trainer "
            f"idle {100 * p['trainer_idle_frac']:.0f} %, rollout idle {100 * p['rollout_idle_frac']:.0f} %; "
            f"overrides: {' '.join(c.dotted())}"]


def colocated_lines(res: dict) -> list[str]:
    """What the best colocated layout (plan/colocated.py) would give, against the table's #1."""
    co = res.get("colocated")
    if co is None:
        return ["colocated (every GPU generates, then trains): no layout fits both phases on a shared GPU (the "
                "trainer with the released engine's share, the engine's KV pool beside the offloaded trainer) "
                "and passes validation"]
    p, lay = co.predicted, co.layout
    line = (f"colocated (every GPU generates, then trains, as verl's and slime's hybrid engine; "
            f"{co.overrides['staleness.mode']}): {p['tokens_per_s']:.0f} ({p['tokens_per_s_sd']:.0f}) tokens/s "
            f"({per_gpu(co, lay.trainer_gpus):.0f} per GPU) with trainer {lay.tp}x{lay.pp}x{lay.dp} and "
            f"{lay.num_servers} x TP{lay.rollout_tp} on the same GPUs, {p['swap_s']:.1f} s of memory swap per step, "
            f"training phase {co.memory_gb:.1f} GiB/GPU")
    if res["ranked"]:
        ratio = p["tokens_per_s"] / res["ranked"][0].predicted["tokens_per_s"]
        line += f": {ratio:.2f}x rank 1"
        if ratio > 1.01:
            line += "; here colocation is the better answer (--colocated-out FILE writes it)"
    return [line, "colocated overrides: " + " ".join(co.dotted())]


def _write_overrides(path: str, best, recipe: str, user: list[str], gpus: int, gpu: str) -> None:
    """The best layout as a recipe that extends the planned one, with the command line's overrides under the
    layout's (`m2po train overrides.yaml` runs what was planned)."""
    from omegaconf import OmegaConf

    nested = OmegaConf.to_container(OmegaConf.merge(OmegaConf.from_dotlist(user),
                                                    OmegaConf.from_dotlist(best.dotted())))
    header = (f"# m2po plan {recipe} --gpus {gpus} --gpu {gpu}: predicted {best.predicted['tokens_per_s']:.0f} "
              f"tokens/s, {best.predicted['steps_per_hour']:.1f} steps/h, staleness mean "
              f"{best.predicted['staleness_mean']:.1f}\n")
    ref = str(Path(recipe).resolve()) if Path(recipe).is_file() else recipe
    Path(path).write_text(header + OmegaConf.to_yaml(OmegaConf.create({"extends": ref, **nested})))
