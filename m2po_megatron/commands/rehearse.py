"""`m2po rehearse RECIPE [overrides]`: one training step of the recipe at full size on fake tensors.

Builds the recipe's trainer (the same MegatronActor `m2po train` builds) at full size under torch's FakeTensorMode
in a fake process group of the recipe's world size, once per pipeline role (first, middle, last stage), and runs
one optimizer mini-batch through the pipeline schedule, the loss and the optimizer step. No GPU and no memory
beyond the model's bookkeeping: a 32B recipe rehearses on a laptop. Per stage it prints the parameters, the
traced peak bytes (weights, gradients, optimizer states, activations, temporaries), models/memory.py's estimate
at the traced settings beside it, the recipe's own estimate against the GPU's memory, and every collective of
the step with its group and bytes. What a CPU cannot trace (Transformer Engine, FP8, FlexAttention, compiled
kernels) is listed in the output; the formula covers it (m2po_megatron.rehearse). A colocated recipe
(cluster.colocate) traces the trainer's phase with the released engine's resident share held on the GPU
(models/colocated_memory.ENGINE_RELEASED_GB, one fake block through the step), and reports both phases'
estimates beside it.

Exit status: 0 when every role ran and its traced peak is within --tolerance of the estimate, 1 otherwise, 2 on
bad input."""
from __future__ import annotations

import argparse
import json
import os


def register(sub) -> None:
    p = sub.add_parser("rehearse", help="one training step of a recipe at full size on fake tensors (no GPU)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="recipe path or name under recipes/ (e.g. paper/qwen3-8b-base)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor_model_parallel_size=2")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="stages rehearsed at once (each in its own process; default: 2 or the CPU count)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per stage (default 600)")
    p.add_argument("--tolerance", type=float, default=10.0,
                   help="largest |estimate - traced| in %% of traced before the exit status is 1 (default 10)")
    p.add_argument("--max-microbatches", type=int, default=None, metavar="N",
                   help="fewer sequences, so that each data-parallel rank runs about N micro-batches (default: "
                        "the whole optimizer mini-batch, 1-2 minutes a dense paper recipe on 2 cores; the peak "
                        "needs only as many as the pipeline keeps in flight, so N below the pipeline depth is raised to it; a mixture-of-experts recipe runs its "
                        "experts one by one and needs this)")
    p.add_argument("--no-fake-cache", action="store_true",
                   help="torch's fake-tensor dispatch cache alone, without the rehearsal's first-level cache "
                        "(infra/fake_cache.py; slower, the same trace)")
    p.add_argument("--fake-cache-crosscheck", type=int, default=0, metavar="N",
                   help="dispatch every Nth hit of the first-level cache again without a cache and compare the "
                        "outputs; a difference fails the stage (1: every hit, several times slower; default 0: "
                        "none)")
    p.add_argument("--format", default="table", choices=("table", "json"))
    p.add_argument("--seed", type=int, default=0, help="seed of the drawn sequence lengths")
    p.set_defaults(func=run)


def run(args) -> int:
    from m2po_megatron.config import ConfigError, load_config
    from m2po_megatron.config.validation import model_hf_config
    from m2po_megatron.rehearse import NOT_TRACED, NOT_TRACED_MOE
    from m2po_megatron.rehearse.plan import minibatch_seqs, report, run_roles, traced_kwargs, verdict

    if args.jobs < 1 or args.timeout_s <= 0 or args.tolerance <= 0 or (
            args.max_microbatches is not None and args.max_microbatches < 1):
        raise ConfigError("--jobs and --max-microbatches must be >= 1, --timeout-s and --tolerance > 0")
    if args.fake_cache_crosscheck < 0 or (args.fake_cache_crosscheck and args.no_fake_cache):
        raise ConfigError(f"--fake-cache-crosscheck {args.fake_cache_crosscheck}: checks every Nth hit of the "
                          "first-level cache; use N >= 0, and 0 with --no-fake-cache (no cache to check)")
    cfg = load_config(args.recipe, args.overrides, check_files=False)
    try:
        kw, changed = traced_kwargs(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    hf = model_hf_config(cfg)
    p = cfg.parallel
    tp, pp, dp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.data_parallel_size
    world = tp * pp * dp * p.context_parallel_size
    max_mb = args.max_microbatches
    if max_mb is not None and max_mb < pp:
        # 1F1B keeps up to PP micro-batches in flight on the first stage: fewer would trace a smaller peak than
        # the step's, and the estimate at the traced settings would not be comparable
        print(f"--max-microbatches {max_mb} raised to the pipeline depth, {pp}: the peak needs that many")
        max_mb = pp
    seqs = minibatch_seqs(cfg, max_mb, seed=args.seed)
    full = minibatch_seqs(cfg)
    held = colocated_held_back(cfg)
    results = run_roles(kw, world_size=world, tp=tp, dp=dp, pp=pp, seqs=seqs,
                        max_new_tokens=cfg.rollout.max_new_tokens, jobs=args.jobs, timeout_s=args.timeout_s,
                        seed=args.seed, fast_cache=not args.no_fake_cache, crosscheck=args.fake_cache_crosscheck,
                        held_back_bytes=held)
    rep = report(cfg, hf, results, kw, float(cfg.cluster.gpu_memory_gb or 0))
    if cfg.cluster.colocate:
        rep["colocated"] = colocated_estimate(cfg, hf)
    rep.update(recipe=str(args.recipe), world_size=world, layout=dict(tp=tp, pp=pp, dp=dp,
               vpp=p.virtual_pipeline_model_parallel_size, ep=p.expert_model_parallel_size,
               sp=bool(p.sequence_parallel)), minibatch_seqs=seqs, recipe_minibatch_seqs=full,
               changed=changed,
               not_traced=list(NOT_TRACED) + (list(NOT_TRACED_MOE) if hf.get("num_experts") or
                                              hf.get("num_local_experts") else []),
               allocator_model="m2po_megatron.infra.fake_world.RehearsalMode")
    rep["ok"], rep["problems"] = verdict(rep, args.tolerance)
    ok = rep["ok"]
    if args.format == "json":
        print(json.dumps(rep, indent=1))
    else:
        print(format_report(rep))
    return 0 if ok else 1


def colocated_held_back(cfg) -> int:
    """Bytes a colocated engine keeps on each GPU through the trainer's phase (0 when not colocated)."""
    from m2po_megatron.models.colocated_memory import ENGINE_RELEASED_GB
    from m2po_megatron.models.memory import GiB

    return int(ENGINE_RELEASED_GB * GiB) if cfg.cluster.colocate else 0


def colocated_estimate(cfg, hf: dict) -> dict:
    """Both phases' estimates of the recipe as written (its heaviest stage), for the report."""
    from m2po_megatron.config import estimate_memory
    from m2po_megatron.models.colocated_memory import colocated_from_config

    return colocated_from_config(cfg, hf, estimate_memory(cfg, hf))


def format_report(rep: dict) -> str:
    lay = rep["layout"]
    lines = [f"rehearsal of {rep['recipe']}: world {rep['world_size']} (TP{lay['tp']} x PP{lay['pp']} x DP{lay['dp']}"
             + (f", VPP{lay['vpp']}" if lay.get("vpp") else "") + (f", EP{lay['ep']}" if lay.get("ep", 1) > 1 else "")
             + (", sequence parallel" if lay.get("sp") else "") + f"), one mini-batch of {rep['minibatch_seqs']} "
             + ("sequences" if rep["minibatch_seqs"] == rep["recipe_minibatch_seqs"] else
                f"of the recipe's {rep['recipe_minibatch_seqs']} sequences (--max-microbatches)")
             + ", fake tensors (allocator model: every storage a block rounded to 512 bytes)"]
    if rep["changed"]:
        lines.append("traced instead of the recipe's: " + "; ".join(rep["changed"]))
    head = (f"{'stage':<9}{'params':>8}{'mbs':>5}{'traced':>9}{'estimate':>10}{'err':>7}  "
            f"{'weights':>8}{'grads':>7}{'optim':>7}{'activ':>7}{'temps':>7}  "
            f"{'recipe est':>10}{'GPU':>6}{'headroom':>9}")
    lines += ["", head]
    for s in rep["stages"]:
        name = f"{s['role']}({s['pp_rank']})"
        if "error" in s:
            lines.append(f"{name:<9} FAILED: {s['error']}")
            lines += ["    " + t for t in (s.get("traceback") or "").strip().splitlines()[-12:]]
            continue
        parts = "".join(f"{s['at_peak_gib'].get(k, 0):>{w}.1f}" for k, w in (
            ("weights", 8), ("grads", 7), ("optimizer", 7), ("activations", 7), ("temporaries", 7)))
        lines.append(
            f"{name:<9}{s['params'] / 1e9:>7.2f}B{s['microbatches']:>5}{s['traced_gib']:>8.1f}G"
            f"{s['estimate_traced_gib']:>9.1f}G{s['error_pct']:>+6.1f}%  {parts}  {s['estimate_recipe_gib']:>9.1f}G"
            f"{s['gpu_gib']:>5.0f}G{s['headroom_gib']:>8.1f}G")
    lines.append("traced: the allocator model's peak (GiB); estimate: models/memory.py's tensor terms at the traced "
                 "settings and stage; recipe est: the formula for the recipe as written (TE/FP8, overhead "
                 "included) against the GPU's memory")
    from m2po_megatron.rehearse.plan import format_reference  # the reference model's share (algo.use_kl_loss)

    lines += format_reference(rep)
    if "colocated" in rep:
        from m2po_megatron.models.colocated_memory import format_colocated

        held = max((s.get("held_back_gib", 0.0) for s in rep["stages"]), default=0.0)
        lines.append(f"colocated: the trainer's phase traced with {held:.1f} GiB of the released engine held on the "
                     "GPU (in traced, estimate and recipe est); both phases of the recipe as written: "
                     + format_colocated(rep["colocated"]))
    for s in rep["stages"]:
        if "error" in s:
            continue
        c = s["dispatch_cache"]
        cache = (f"first-level dispatch cache {c['hits']} hits, {c['misses']} misses"
                 + (f", {c['checked']} crosschecked (every {c['crosscheck']})" if c["crosscheck"] else "")
                 if c["fast"] else "torch's dispatch cache alone")
        lines.append(f"\ncollectives of {s['role']} stage (build {s['build_s']:.0f} s, step {s['step_s']:.0f} s; "
                     f"{cache}):")
        for c in s["collectives"]:
            lines.append(f"  {c['call']:<24}{c['group']:<18}{c['count']:>6} x  {c['bytes'] / 2**20:>12.1f} MiB")
    lines.append("\nnot traced (from the formula instead):")
    lines += [f"  - {t}" for t in rep["not_traced"]]
    lines.append("\nOK: every stage ran and its estimate is within tolerance" if rep["ok"] else
                 "\nNOT OK:\n" + "\n".join(f"  - {p}" for p in rep["problems"]))
    return "\n".join(lines)
