"""`m2po preflight`: does the stack work on this allocation? Run it first on a fresh one (docs/preflight.md).

    m2po preflight [RECIPE] [k=v ...] [--json PATH] [--only CHECK,...] [--timeout-scale X]
    sbatch -N 2 --gpus-per-node=8 slurm/preflight.sbatch RECIPE      # across the job's nodes

Checks, each in its own process group under its own time limit: ray (the recipe's placement), comm
(all-reduce and broadcast bandwidth against the planner's link figures), te (Transformer Engine, FP8 against
bf16), engine (a tiny rollout server, a weight update, a generation that shows it) and memory (the estimate
against one real step). Prints a table and writes one JSON summary (default RUN_DIR/preflight/summary.json).
Exit 0 when no check failed (skipped ones do not count), 1 when one did, 2 for bad input (an unknown check, a
recipe that does not load) before any check runs."""
from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    p = sub.add_parser("preflight", help="check the stack on a fresh allocation: Ray, collectives, TE/FP8, a rollout "
                                         "server and its weight update, the memory estimate",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", nargs="?", default=None, help="recipe path or name (default: the built-in defaults: "
                                                          "CPU server, one node)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. cluster.ray_address=HEAD:PORT")
    p.add_argument("--json", default=None, metavar="PATH", help="where the JSON summary goes (default "
                                                                 "RUN_DIR/preflight/summary.json)")
    p.add_argument("--only", default=None, metavar="CHECK,...", help="run these checks only (names: ray, comm, te, "
                                                                     "engine, memory)")
    p.add_argument("--timeout-scale", type=float, default=1.0, metavar="X",
                   help="multiply every check's time limit (default 1; e.g. 2 on a first, cold start)")
    p.set_defaults(func=run)


def _bad(msg: str) -> int:
    print(f"m2po preflight: {msg}", file=sys.stderr)
    return 2


def selected(only: str | None) -> list:
    """The checks to run, in CHECKS' order; ValueError naming an unknown one."""
    from m2po_megatron.preflight.checks import CHECKS

    if not only:
        return list(CHECKS.values())
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise ValueError(f"--only {only!r}: unknown check(s) {unknown}; choose from {', '.join(CHECKS)}")
    return [c for n, c in CHECKS.items() if n in names]


def _device() -> tuple[bool, str]:
    from m2po_megatron.infra.device import has_cuda

    if not has_cuda():
        return False, "cpu"
    import torch

    return True, f"cuda: {torch.cuda.device_count()} x {torch.cuda.get_device_name()}"


def run(args) -> int:
    import secrets
    from pathlib import Path

    from m2po_megatron.config import load_config, run_dir
    from m2po_megatron.preflight.checks import Result, run_check
    from m2po_megatron.preflight.summary import document, exit_code, table, write_json
    from m2po_megatron.run.servers import api_key

    try:
        checks = selected(args.only)
    except ValueError as e:
        return _bad(str(e))
    if not args.timeout_scale > 0:
        return _bad(f"--timeout-scale {args.timeout_scale}: give a positive factor, e.g. 2")
    cfg = load_config(args.recipe, list(args.overrides), check_files=False)  # ConfigError: exit 2 (cli.py)
    work = run_dir(cfg) / "preflight"
    out = Path(args.json) if args.json else work / "summary.json"
    if out.parent.exists() and not out.parent.is_dir():
        return _bad(f"--json {out}: {out.parent} is not a directory")
    work.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    gpu, device = _device()
    ctx = {"gpu": gpu, "work_dir": str(work.resolve()), "api_key": api_key(cfg) or secrets.token_urlsafe(24),
           "ray_address": None, "local_ray": False}
    print(f"m2po preflight: {len(checks)} check(s) on {device}; work dir {work}", flush=True)
    results: list[Result] = []
    ray_error = None
    try:
        if any(c.needs_ray for c in checks):
            try:
                ctx.update(_start_ray(cfg))
            except Exception as e:  # noqa: BLE001 - every Ray check reports it
                ray_error = f"{type(e).__name__}: {str(e)[:300]}"
        for c in checks:
            if c.needs_ray and ray_error:
                res = Result(c.name, "fail", 0.0, c.limit_s * args.timeout_scale,
                             cause=f"Ray did not start or join ({ray_error})",
                             fix="check cluster.ray_address (HEAD:PORT of the job's Ray head, or local) and the "
                                 "ray-head log (docs/cluster.md)")
            else:
                res = run_check(c, args.recipe, list(args.overrides), ctx, args.timeout_scale)
            print(f"  {c.name}: {res.status} ({res.seconds:.0f} s)", flush=True)
            results.append(res)
    finally:
        if ctx["local_ray"]:
            from m2po_megatron.infra.cluster import shutdown_ray

            shutdown_ray()
    doc = document(results, recipe=args.recipe, device=device,
                   ray_address=None if ctx["local_ray"] else ctx["ray_address"])
    write_json(doc, str(out))
    print(table(results))
    print(f"summary: {out}")
    return exit_code(results)


def _start_ray(cfg) -> dict:
    """A private local Ray for the checks to join (cluster.ray_address=local), sized as a run's; or the
    recipe's cluster, which the checks join themselves."""
    address = cfg.cluster.ray_address
    if address != "local":
        return {"ray_address": address, "local_ray": False}
    import ray

    from m2po_megatron.infra.cluster import init_ray

    p = cfg.parallel
    world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size \
        * p.data_parallel_size
    init_ray("local", tmpdir=cfg.cluster.ray_tmpdir, object_store_memory_mb=min(cfg.cluster.object_store_memory_mb,
                                                                                 256),
             trainer_slots=max(world, 2), rollout_slots=cfg.rollout.num_servers + 1)
    return {"ray_address": ray.get_runtime_context().gcs_address, "local_ray": True}
