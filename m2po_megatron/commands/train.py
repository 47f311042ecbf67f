"""`m2po train RECIPE [overrides]`: run the RL loop (m2po_megatron/train.py)."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("train", help="train with a recipe (M2PO/GRPO/GSPO on stale rollouts)",
                       description="Validate RECIPE with dotted overrides (e.g. algo.m2po.tau=0.02 "
                                   "train.steps=10), then start Ray, the rollout servers and the Megatron "
                                   "ranks and run the RL loop. The run directory is run.output_dir/run.name.")
    p.add_argument("recipe", help="recipe path or name under recipes/ (e.g. tiny-cpu)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. staleness.max_staleness=8")
    p.add_argument("--resume", default=None, metavar="auto|none|PATH",
                   help="continue from the latest checkpoint of the run (auto) or a checkpoint path "
                        "(same as run.resume=...)")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in a run directory that holds another run; the old one is moved to "
                        "RUN_DIR.replaced-TIME (same as run.overwrite=true)")
    p.add_argument("--allow-change", action="append", default=[], metavar="KEY[,KEY...]|all",
                   help="let a resume change these config keys (algo.name, a section such as staleness, or all); "
                        "without it a resume that changes the algorithm, staleness, model, layout, data, ... "
                        "stops naming each key. Safe keys (train.steps, logging, eval.interval, ...) always "
                        "may change; every start is recorded in RUN_DIR/config_history.jsonl")
    p.set_defaults(func=run)


def run(args) -> int:
    from m2po_megatron.config import load_config
    from m2po_megatron.run.config_guard import parse_allowed

    allowed = parse_allowed(args.allow_change)  # a misspelt key stops before anything is loaded
    overrides = list(args.overrides) + ([f"run.resume={args.resume}"] if args.resume else [])
    overrides += ["run.overwrite=true"] if args.overwrite else []
    _build_missing_tiny_task(args.recipe, overrides)
    cfg = load_config(args.recipe, overrides)  # every recipe error surfaces here, before Ray starts
    from m2po_megatron.train import train

    rdir = train(cfg, allow_change=allowed)
    print(f"[m2po] run directory: {rdir}")
    return 0


def _build_missing_tiny_task(recipe: str, overrides: list[str]) -> None:
    """A fresh clone has no .cache/: build the project's own tiny task that the recipe trains, if missing
    (m2po_megatron/demo/autobuild.py), so that validation finds it. A recipe that does not load is left to the
    validation that follows, which reports it."""
    from m2po_megatron.config import ConfigError, load_config
    from m2po_megatron.demo.autobuild import build_missing_tiny_task

    try:
        hf_path = load_config(recipe, overrides, check_files=False).model.hf_path
    except ConfigError:
        return
    build_missing_tiny_task(hf_path)
