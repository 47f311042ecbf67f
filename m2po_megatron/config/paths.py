"""Where the paths a recipe names point: one rule, applied here and nowhere else (docs/training.md, "Paths").

- A relative path written in a file (a recipe, a parent named by `extends:`, a sweep file) is relative to that
  file's directory, as docker-compose and tsconfig read theirs, except one whose first folder is one of the
  project's own (PROJECT_FOLDERS: .cache/, data/, models/, recipes/, examples/, ...): that one is relative to the
  project root, so the recipes under recipes/ can name `.cache/tiny-task` or `m2po_megatron/assets/...`. Start
  a path with `./` to mean the file's own folder even then. A `${oc.env:VAR,default}` default is written in the
  file and follows the same rule; the variable's value, when set, does not (below).
- A path given on the command line (the recipe argument, a dotted override) or by an environment variable is
  relative to the working directory, as any shell command's arguments are.
- A recipe reference (the command-line recipe, `extends:`, a sweep's `recipe:`) may also be a name under
  recipes/ (`tiny-cpu`, `paper/qwen3-4b-base.yaml`).
- Outputs (run.output_dir, a sweep's output_dir) are relative to the working directory, as Megatron's --save.

load_config rewrites the input paths of each layer (a file, the overrides) to absolute ones before merging, so
the merged config, everything that reads it and the config.yaml of a run name the same files from any working
directory.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Optional

import yaml

PROJECT_ROOT = Path(__file__).resolve().parents[2]
RECIPES_DIR = PROJECT_ROOT / "recipes"
# The project's top-level folders a recipe's input path may start at (data/ and models/ are the defaults of
# M2PO_DATA_DIR and M2PO_MODELS_DIR; .cache/ holds the tiny tasks the project builds).
PROJECT_FOLDERS = (".cache", "data", "examples", "m2po_megatron", "models", "recipes", "tests", "tools")

# The recipe fields that name files or directories to read, and those naming a `path/to/file.py:name` plug-in.
# Outputs (run.output_dir, cluster.ray_tmpdir) are not here: they are the working directory's.
PATH_FIELDS = ("model.hf_path", "model.hf_config", "model.tokenizer", "model.megatron_ckpt", "run.resume",
               "data.train_path", "data.eval_paths")
PLUGIN_FIELDS = ("rollout.function", "eval.function", "reward.function", "reward.terms")
NOT_PATHS = {"run.resume": ("none", "auto")}  # run.resume's words

_ENV_DEFAULT = re.compile(r"^\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*),([^'\"${}]+)\}(.*)$", re.S)


def written_path(ref: str, base_dir: Optional[Path]) -> str:
    """`ref` as an absolute path: written in a file in `base_dir` (the rule above), or given on the command line
    when `base_dir` is None. A value with an interpolation keeps it; only a `${oc.env:VAR,default}` default is
    resolved (the variable's value is the working directory's, as it is the shell's)."""
    if "${" in ref:
        m = _ENV_DEFAULT.match(ref)
        if not m or base_dir is None:
            return ref
        name, default, rest = m.groups()
        return f"${{oc.env:{name},{_quoted(written_path(default.strip(), base_dir))}}}{rest}"
    expanded = os.path.expandvars(os.path.expanduser(ref))
    if not expanded or os.path.isabs(expanded):
        return expanded
    first = expanded.replace(os.sep, "/").split("/", 1)[0]
    if base_dir is None:
        base = Path.cwd()
    elif first in PROJECT_FOLDERS:
        base = PROJECT_ROOT
    else:
        base = base_dir
    return os.path.normpath(base / expanded)


def _quoted(default: str) -> str:
    """An oc.env default OmegaConf reads back as written (quoted when it holds its grammar's characters)."""
    return default if re.fullmatch(r"[\w./~+@%-]+", default) else "'" + default.replace("'", "\\'") + "'"


def plugin_ref(spec: str, base_dir: Optional[Path]) -> str:
    """A plug-in name with its `file.py` part resolved by written_path; registered names and `module:name` kept."""
    target, sep, attr = spec.strip().rpartition(":")
    if not sep or not target.endswith(".py"):
        return spec
    return f"{written_path(target, base_dir)}:{attr}"


def resolve_layer(data: dict, base_dir: Optional[Path]) -> dict:
    """The input paths of one layer (a recipe file's mapping, or the parsed overrides when `base_dir` is None)
    rewritten to absolute ones, in place. Values of the wrong type are left for validation to name."""
    for key in PATH_FIELDS + PLUGIN_FIELDS:
        section, leaf = key.split(".")
        sub = data.get(section)
        if not isinstance(sub, dict) or leaf not in sub:
            continue
        sub[leaf] = resolve_value(key, sub[leaf], base_dir)
    return data


def resolve_value(key: str, value: Any, base_dir: Optional[Path]) -> Any:
    """One field's value (see resolve_layer)."""
    if key == "reward.terms":
        return [dict(t, function=plugin_ref(t["function"], base_dir))
                if isinstance(t, dict) and isinstance(t.get("function"), str) else t
                for t in value] if isinstance(value, list) else value
    if isinstance(value, list):
        return [resolve_value(key, v, base_dir) for v in value]
    if not isinstance(value, str) or not value or value in NOT_PATHS.get(key, ()):
        return value
    return plugin_ref(value, base_dir) if key in PLUGIN_FIELDS else written_path(value, base_dir)


def resolve_override(item: str, base_dir: Path) -> str:
    """A dotted override written in a file in `base_dir` (a sweep's `overrides:`), its path resolved there, as
    an override the command line can pass on (`model.hf_path=.cache/x` -> `model.hf_path=/abs/.cache/x`)."""
    key, sep, raw = item.partition("=")
    name = key.strip().lstrip("+")
    if not sep or name not in PATH_FIELDS + PLUGIN_FIELDS:
        return item
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return item  # load_config names the bad value
    new = resolve_value(name, value, base_dir)
    return item if new == value else f"{key}={_yaml_value(new)}"


def _yaml_value(value: Any) -> str:
    if isinstance(value, str):
        try:
            if yaml.safe_load(value) == value and "${" not in value:
                return value
        except yaml.YAMLError:
            pass
    return json.dumps(value)  # JSON is YAML: a list, or a string with characters plain YAML would read otherwise


def resolve_path(ref: str) -> Path:
    """A path the running program was given (a loaded config's value, whose recipe paths load_config made
    absolute, an argument, an environment variable): `~` and $VARs expanded, relative to the working directory."""
    return Path(os.path.expandvars(os.path.expanduser(ref)))


def recipe_candidates(ref: str, base_dir: Optional[Path]) -> list[Path]:
    """Where a recipe reference may be: the path (written in a file in `base_dir`, or on the command line when
    None), then a name under recipes/; each also with `.yaml` added."""
    cands = [Path(written_path(ref, base_dir)), RECIPES_DIR / os.path.expanduser(ref)]
    cands = list(dict.fromkeys(cands))
    return cands + [c.with_name(c.name + ".yaml") for c in cands if c.suffix != ".yaml"]


def project_relative(p: str | Path) -> str:
    """`p` as the docs and the Makefile name it: relative to the project root when it is inside it, else as is."""
    try:
        return str(Path(p).relative_to(PROJECT_ROOT))
    except ValueError:
        return str(p)
