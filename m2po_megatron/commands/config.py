"""`m2po config RECIPE [overrides]`: validate a recipe and print the resolved config (secrets redacted)."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("config", help="validate a recipe and print the resolved config",
                       description="Load RECIPE (following `extends:`), apply dotted overrides such as "
                                   "algo.m2po.tau=0.02, validate everything and print the result as YAML.")
    p.add_argument("recipe", help="recipe path or name under recipes/ (e.g. tiny-cpu)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=10")
    p.add_argument("--no-check-files", action="store_true",
                   help="do not require model/data paths to exist (validate a cluster recipe off-cluster)")
    p.set_defaults(func=run)


def run(args) -> int:
    import yaml

    from m2po_megatron.config import estimate_memory, load_config, model_hf_config, redact
    from m2po_megatron.models.memory import format_estimate

    cfg = load_config(args.recipe, args.overrides, check_files=not args.no_check_files)
    print(yaml.safe_dump(redact(cfg), sort_keys=False), end="")
    est = estimate_memory(cfg)  # YAML comments, so the output stays a valid recipe
    print("# memory estimate per trainer GPU: " + (format_estimate(est) if est else
                                                   "unknown (no model config.json; set model.hf_config)"))
    if est and cfg.cluster.colocate:
        print("# " + colocated_line(cfg, model_hf_config(cfg), est))
    return 0


def colocated_line(cfg, hf: dict, est: dict) -> str:
    """Each phase of a colocated step (generation, training, weight_sync) on one shared GPU
    (models/colocated_memory.py)."""
    from m2po_megatron.models.colocated_memory import colocated_from_config, format_colocated

    co = colocated_from_config(cfg, hf, est)
    gpu = cfg.cluster.gpu_memory_gb
    return ("colocated, per shared GPU" + (f" of {gpu:g} GiB" if gpu else " (set cluster.gpu_memory_gb to check "
                                                                          "the KV pool SGLang would get)")
            + ": " + format_colocated(co))
