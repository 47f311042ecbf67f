"""Recipe loading: YAML with `extends:`, dotted command-line overrides, and writing the resolved config
(secrets redacted).

`load_config(path, overrides)` merges, in order: the schema's defaults, the chain of recipes named by
`extends:` (parent first), the recipe itself, then the overrides (`algo.m2po.tau=0.02`), and validates the
result before any expensive work starts.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from m2po_megatron.config.paths import RECIPES_DIR, recipe_candidates, resolve_layer
from m2po_megatron.config.schema import ALL_FIELDS, ConfigError, RunConfig, field_type
from m2po_megatron.config.validation import validate

SECRET_MARKERS = ("api_key", "token", "secret", "password")


# The anchors' names (Megatron, verl, slime, Hugging Face) for fields named otherwise here, so that a misspelled
# `optim.learning_rate` suggests `optim.lr` rather than the nearest spelling in this schema.
ANCHOR_NAMES = {
    "optim.learning_rate": "optim.lr",  # HF TrainingArguments
    "optim.lr_warmup_iters": "optim.warmup_updates",  # Megatron --lr-warmup-iters
    "optim.lr_warmup_steps": "optim.warmup_updates",  # verl actor.optim.lr_warmup_steps
    "optim.warmup_steps": "optim.warmup_updates",  # HF
    "optim.lr_decay_style": "optim.lr_schedule",  # Megatron --lr-decay-style
    "optim.lr_scheduler_type": "optim.lr_schedule",  # HF
    "optim.max_grad_norm": "optim.clip_grad",  # HF
    "optim.grad_clip": "optim.clip_grad",  # verl actor.grad_clip
    "optim.adam_epsilon": "optim.adam_eps",  # HF
    "model.path": "model.hf_path",  # verl actor_rollout_ref.model.path
    "data.prompt_key": "data.input_key",  # verl
    "data.train_files": "data.train_path",  # verl
    "data.val_files": "data.eval_paths",  # verl
    "rollout.n": "rollout.n_samples_per_prompt",  # verl rollout.n
    "rollout.response_length": "rollout.max_new_tokens",  # verl rollout.response_length
    "rollout.tensor_model_parallel_size": "rollout.tp_size",  # verl rollout.tensor_model_parallel_size
    "rollout.gpu_memory_utilization": "rollout.mem_fraction_static",  # verl / vLLM
    "train.total_training_steps": "train.steps",  # verl trainer.total_training_steps
    "train.train_iters": "train.steps",  # Megatron --train-iters
    "checkpoint.save_interval": "checkpoint.interval",  # Megatron --save-interval
    "checkpoint.save_freq": "checkpoint.interval",  # verl trainer.save_freq
    "eval.test_freq": "eval.interval",  # verl trainer.test_freq
    "eval.eval_interval": "eval.interval",  # Megatron --eval-interval
}


def _suggest(key: str) -> str:
    """The closest field to an unknown key, matching the anchors' names (ANCHOR_NAMES) as well as ours."""
    names = {**{f: f for f in ALL_FIELDS}, **ANCHOR_NAMES}
    close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.6)
    if not close:  # try the leaf name alone, anywhere in the schema
        leaves = {p.rsplit(".", 1)[-1]: p for p in names}
        m = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(leaves), n=1, cutoff=0.7)
        close = [leaves[m[0]]] if m else []
    return f"; did you mean '{names[close[0]]}'?" if close else ""


REMOVED = {
    "rollout.router": "the client balances over the servers itself (weight sync, pause and abort must reach "
                      "every server anyway), so sglang-router is not used; delete the key",
    "rollout.update_mode": "SGLang 0.5.23 cannot update weights while requests run (an update waits for every "
                           "running request; tokens never change version mid-sequence), so every update pauses; "
                           "use rollout.pause_mode = in_place to keep running requests and continue them with "
                           "the new weights",
}


def _check_keys(data: Any, schema: Any, prefix: str, source: str) -> None:
    """Unknown keys fail with the closest valid key (OmegaConf's own message lacks the suggestion)."""
    if not isinstance(data, dict):
        return
    names = {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    if names is None:
        return
    for key, value in data.items():
        path = f"{prefix}{key}"
        if path in REMOVED:
            raise ConfigError(f"{source}: '{path}' was removed: {REMOVED[path]}")
        if key not in names:
            raise ConfigError(f"{source}: unknown key '{path}'{_suggest(path)}")
        sub = getattr(schema, key)
        if dataclasses.is_dataclass(sub):
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"{source}: '{path}' must be a mapping of its fields, got {value!r}")
            _check_keys(value, sub, path + ".", source)


def resolve_recipe_path(ref: str, base_dir: Optional[Path] = None) -> Path:
    """A recipe reference (config/paths.py): a path written in a recipe or sweep file in `base_dir`, or given
    on the command line (relative to the working directory) when `base_dir` is None; else a recipe name under
    recipes/, with or without `.yaml`."""
    cands = recipe_candidates(ref, base_dir)
    for c in cands:
        if c.is_file():
            return c.resolve()
    where = f"the folder of the file naming it, {base_dir}" if base_dir else f"the working directory, {Path.cwd()}"
    raise ConfigError(f"recipe '{ref}' not found (looked in {', '.join(str(c) for c in cands[:2])}, ...); a path "
                      f"is relative to {where}, or give a name under {RECIPES_DIR} (docs/training.md, Paths)")


def _read_recipe_chain(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict]]:
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise ConfigError(f"recipe inheritance loop: {chain}; remove one `extends:`")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of sections, got {type(data).__name__}")
    _acyclic(data, str(path))
    parent = data.pop("extends", None)
    chain: list[tuple[Path, dict]] = []
    if parent:
        parents = parent if isinstance(parent, list) else [parent]
        for ref in parents:
            chain += _read_recipe_chain(resolve_recipe_path(str(ref), path.parent), (*seen, path))
    chain.append((path, resolve_layer(data, path.parent)))
    return chain


def _acyclic(value: Any, where: str, seen: tuple = ()) -> None:
    """YAML anchors can build a list that contains itself (`&a [*a]`); no config value can be one."""
    if isinstance(value, (list, dict)):
        if any(value is s for s in seen):
            raise ConfigError(f"{where}: the value refers to itself (a YAML anchor loop); write it out")
        for v in value.values() if isinstance(value, dict) else value:
            _acyclic(v, where, (*seen, value))


def parse_overrides(overrides: list[str]) -> dict:
    """Dotted command-line overrides (`algo.m2po.tau=0.02`, values in YAML, a later one wins) as a nested
    dict, parsed by OmegaConf's dotlist grammar one item at a time so an error names the item."""
    conf = OmegaConf.create()
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like section.field=value (e.g. algo.m2po.tau=0.02)")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("+")  # Hydra's `+key=value` spelling: every key is in the schema anyway
        if not key:
            raise ConfigError(f"override '{item}' has no key")
        try:
            conf.merge_with_dotlist([f"{key}={raw}"])
        except yaml.YAMLError as e:
            raise ConfigError(f"override '{item}': the value is not valid YAML ({str(e).splitlines()[0]}); "
                              f"quote it, e.g. {key}='\"...\"'") from None
        except (OmegaConfBaseException, ValueError, TypeError, KeyError, IndexError, RecursionError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"override '{item}': {first}; write it as section.field=value "
                              f"(e.g. algo.m2po.tau=0.02)") from None
    return OmegaConf.to_container(conf, resolve=False)  # type: ignore[return-value]


def load_config(recipe: Optional[str | Path] = None, overrides: Optional[list[str]] = None,
                check_files: bool = True) -> DictConfig:
    """Load, merge and validate a run config. Raises ConfigError naming the field and the fix."""
    layers: list[tuple[str, dict]] = []
    if recipe is not None:
        path = resolve_recipe_path(str(recipe))
        layers += [(str(p), d) for p, d in _read_recipe_chain(path)]
    if overrides:
        layers.append(("command-line override", resolve_layer(parse_overrides(overrides), None)))

    cfg = OmegaConf.structured(RunConfig)
    for source, data in layers:
        _check_keys(data, RunConfig(), "", source)
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.create(data))
        except ValidationError as e:
            key = getattr(e, "full_key", None) or "?"
            first = str(e).strip().splitlines()[0]
            raise ConfigError(f"{source}: '{key}' has the wrong type: {first}; "
                              f"expected {field_type(key)}") from None
        except (ConfigKeyError, OmegaConfBaseException, TypeError, ValueError, RecursionError) as e:  # a.list.x=1
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"{source}: cannot apply {_leaves(data)}: {first}; check the keys and the "
                              f"value types against `m2po config RECIPE`") from None
    try:
        validate(cfg, check_files=check_files)
    except ConfigError:
        if recipe is not None and not cfg.model.hf_path and not cfg.model.hf_config:
            children = _extended_by(path)  # a recipe naming no model may be a base the others extend
            if children:
                raise ConfigError(f"{path} is a base that other recipes extend ({', '.join(children)}): it names "
                                  f"no model, so it does not run alone; give one of those, or a recipe with "
                                  f"`extends: {path}` and a model section") from None
        raise
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _extended_by(path: Path) -> list[str]:
    """The recipes beside `path` and under recipes/ whose `extends:` names it (only read when it fails)."""
    found = []
    for f in sorted({*path.parent.glob("*.yaml"), *RECIPES_DIR.rglob("*.yaml")}):
        try:
            parents = (yaml.safe_load(f.read_text()) or {}).get("extends") or []
            parents = [resolve_recipe_path(str(r), f.parent) for r in (parents if isinstance(parents, list) else [parents])]
        except (OSError, yaml.YAMLError, AttributeError, ConfigError):
            continue
        if path in parents:
            found.append(f.name if f.parent == path.parent else str(f))
    return found


def _leaves(data: Any, prefix: str = "") -> str:
    if isinstance(data, dict):
        return ", ".join(_leaves(v, f"{prefix}{k}.") for k, v in data.items()) or prefix.rstrip(".")
    return prefix.rstrip(".")


def is_secret(key: str) -> bool:
    """Names of credentials (api_key, wandb_api_key, hf_token, secret, password), not metrics such as
    `tokens_per_s/gen` or `staleness/token_mean`."""
    leaf = re.split(r"[./]", key.lower())[-1]
    return any(leaf == m or leaf.endswith("_" + m) for m in SECRET_MARKERS)


def redact(obj: Any) -> Any:
    """A plain copy with secret-looking fields replaced by '***' (set ones) so they never reach disk/logs."""
    if isinstance(obj, DictConfig):
        obj = OmegaConf.to_container(obj, resolve=True)
    if isinstance(obj, dict):
        return {k: ("***" if is_secret(str(k)) and v else redact(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return obj


def run_dir(cfg: DictConfig) -> Path:
    return Path(cfg.run.output_dir) / cfg.run.name


def save_resolved(cfg: DictConfig, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / "config.yaml"
    out.write_text(yaml.safe_dump(redact(cfg), sort_keys=False))
    return out


def secret(cfg_value: Optional[str], env: str) -> Optional[str]:
    """A secret from the config or, preferably, the environment."""
    return os.environ.get(env) or cfg_value


def as_plain(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
