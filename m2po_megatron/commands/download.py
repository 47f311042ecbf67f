"""`m2po download RECIPE [overrides]` (or `m2po download HF_ID --out DIR`): fetch a model's HF weights from the
Hugging Face hub into the directory the recipe reads (model.hf_path) and check them."""
from __future__ import annotations

import os
import re
import sys


def register(sub) -> None:
    p = sub.add_parser("download", help="fetch a recipe's model weights from the Hugging Face hub and check them",
                       description="Download the recipe's model (model.hf_id, else the hub repo its bundled "
                                   "model.hf_config is named after) into model.hf_path with huggingface_hub "
                                   "(HF_TOKEN, HF_HOME, HF_ENDPOINT apply), then check it: config.json has the "
                                   "shapes of model.hf_config, the safetensors hold every tensor the Megatron "
                                   "converter reads, the tokenizer loads. A complete directory is only checked.")
    p.add_argument("recipe", help="recipe path or name under recipes/ (e.g. paper/qwen3-8b-base), or a hub repo "
                                  "id (e.g. Qwen/Qwen3-8B-Base) with --out")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.hf_path=/scratch/models/Qwen3-8B-Base")
    p.add_argument("--out", default=None, help="download the hub repo RECIPE names into this directory instead")
    p.add_argument("--revision", default=None, help="branch, tag or commit of the hub repo (default: main)")
    p.add_argument("--dry-run", action="store_true",
                   help="say what would be downloaded where, check an existing directory, download nothing")
    p.set_defaults(func=run)


def run(args) -> int:
    from m2po_megatron.models.check import WeightsError, weight_problems
    from m2po_megatron.models.download import ALLOW_PATTERNS, fetch

    hf_id, target, reference = _plan(args)
    print(f"model {hf_id}{'@' + args.revision if args.revision else ''} -> {target}"
          + (f" (shapes checked against {reference})" if reference else ""))
    if args.dry_run:
        print(f"files: {' '.join(ALLOW_PATTERNS)}")
        if not os.path.isdir(target):
            print(f"{target} does not exist: it would be downloaded")
            return 0
        problems = weight_problems(target, reference)
        print(f"{target}: " + ("complete; nothing would be downloaded" if not problems else
                               "incomplete: " + "; ".join(problems)))
        return 0
    try:
        fetch(hf_id, target, revision=args.revision, reference=reference)
    except WeightsError as e:
        print(f"m2po download: {e}", file=sys.stderr)
        return 2
    return 0


def _plan(args) -> tuple[str, str, str | None]:
    """(hub repo id, absolute target directory, reference config.json or None), or ConfigError (exit 2)."""
    from m2po_megatron.config import ConfigError, load_config, resolve_path
    from m2po_megatron.config.files import tiny_task_hint
    from m2po_megatron.models.download import bundled_config, hf_id_from_config_path
    from m2po_megatron.models.hf_config import read_hf_config

    if args.out is not None:
        if args.overrides or args.recipe.endswith((".yaml", ".yml")) or os.path.isfile(args.recipe):
            raise ConfigError(f"with --out, give a hub repo id such as Qwen/Qwen3-8B-Base (got "
                              f"{' '.join([args.recipe, *args.overrides])!r}); to download a recipe's model, "
                              f"drop --out and set model.hf_path instead")
        hf_id, target, given = args.recipe, args.out, None
    else:
        cfg = load_config(args.recipe, args.overrides, check_files=False)
        if not cfg.model.hf_path:
            raise ConfigError(f"{args.recipe}: model.hf_path is not set, so there is nowhere to download to; set it "
                              f"(model.hf_path=DIR), or use `m2po download HF_ID --out DIR`")
        hf_id = cfg.model.hf_id or hf_id_from_config_path(cfg.model.hf_config)
        if not hf_id and ("tiny-task" in cfg.model.hf_path or "tiny-agent-task" in cfg.model.hf_path):
            raise ConfigError(f"{args.recipe}: its model is not on the hub: {tiny_task_hint(cfg.model.hf_path)}")
        if not hf_id:
            raise ConfigError(f"{args.recipe}: no hub repo for model.hf_path = {cfg.model.hf_path!r}; set "
                              f"model.hf_id (e.g. model.hf_id=Qwen/Qwen3-8B-Base)")
        target, given = cfg.model.hf_path, cfg.model.hf_config
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", hf_id):
        raise ConfigError(f"model.hf_id = {hf_id!r} is not a hub repo id; write it as ORG/NAME "
                          f"(e.g. Qwen/Qwen3-8B-Base)")
    reference = None
    if given:
        ref = resolve_path(given)
        ref = ref / "config.json" if ref.is_dir() else ref
        if not ref.is_file():
            raise ConfigError(f"model.hf_config = {given!r}: no config.json there, so the download cannot be "
                              f"checked; give the model's config.json (the bundled ones are in "
                              f"m2po_megatron/assets/configs/)")
        reference = str(ref)
    elif bundled_config(hf_id) is not None:
        reference = str(bundled_config(hf_id))
    if reference is not None:
        try:
            read_hf_config(reference)
        except ValueError as e:  # unsupported architecture, missing field, not JSON
            raise ConfigError(f"{reference}: {e}") from None
    return hf_id, os.path.abspath(os.path.expanduser(target)), reference
