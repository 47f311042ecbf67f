"""The files a recipe names (model weights, data): whether they exist, and how to get a missing one. Every
message names the field and the command that produces the file."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from m2po_megatron.config.paths import project_relative


def raw_value(cfg: DictConfig, path: str) -> str:
    """The value of `path` (dotted, list items as [i]) as written in the recipe, interpolations unresolved."""
    node: Any = OmegaConf.to_container(cfg, resolve=False)
    for part in re.findall(r"[^.\[\]]+", path):
        node = node[int(part)] if isinstance(node, list) and part.isdigit() and int(part) < len(node) else (
            node.get(part) if isinstance(node, dict) else None)
    return str(node)


def missing_file_hint(cfg: DictConfig, path: str, value: str, what: str) -> str:
    """How to get a missing model or data file: the tiny task is built by `m2po demo`; paper recipes find
    weights and data through M2PO_MODELS_DIR / M2PO_DATA_DIR."""
    raw = raw_value(cfg, path)
    if "tiny-task" in value or "tiny-agent-task" in value:
        return tiny_task_hint(value)
    fetch = download_hint(cfg) if path == "model.hf_path" else ""
    for env, how in (("M2PO_MODELS_DIR", "the directory holding the HF weights"),
                     ("M2PO_DATA_DIR", "DIR where `m2po prepare-data ... --out DIR/deepscaler` wrote")):
        if env in raw:
            return (f"{fetch}set {env} to {how} (now {os.environ.get(env, 'unset')}; the recipe reads {raw}), or "
                    f"validate the recipe without files: `m2po config RECIPE --no-check-files`")
    return f"{fetch}give an existing {what}, or validate without files: `m2po config RECIPE --no-check-files`"


def download_hint(cfg: DictConfig) -> str:
    """'fetch the weights with `m2po download RECIPE` (...), or ' when the recipe names the weights' hub repo
    (model.hf_id, or a bundled model.hf_config named ORG__NAME), else ''. RECIPE is the one just given."""
    from m2po_megatron.models.download import hf_id_from_config_path  # torch: only when a file is missing

    hf_id = cfg.model.hf_id or hf_id_from_config_path(cfg.model.hf_config)
    if not hf_id:
        return ""
    where = os.path.abspath(os.path.expanduser(str(cfg.model.hf_path)))
    return f"fetch the weights with `m2po download RECIPE` (the hub's {hf_id} into {where}, then checked), or "


# The tiny-task directories the project's own commands build, and the command that builds each.
TINY_TASK_BUILDERS = {
    ".cache/tiny-task": "`m2po demo` (or `make demo`)",
    ".cache/tiny-task-toy": "`make toy-table1` (or `python tools/build_tiny_model.py .cache/tiny-task-toy --seed 0 "
                           "--target-accuracy 0.4`)",
    ".cache/tiny-task-fair": "`make toy-table1-fair` (its first line builds it: see the Makefile)",
    ".cache/tiny-task-moe": "`make demo-moe` (or `python tools/build_tiny_model.py .cache/tiny-task-moe --seed 0 "
                            "--target-accuracy 0.4 --moe`)",
    ".cache/tiny-agent-task": "`make demo-agent` (or `python tools/build_tiny_model.py .cache/tiny-agent-task --seed 0 "
                              "--agent`)",
}


def tiny_task_hint(value: str) -> str:
    """Name the missing tiny-task directory of `value` and the command that builds it."""
    parts = Path(os.path.expanduser(value)).parts
    i = next(k for k, p in enumerate(parts) if "tiny-task" in p or "tiny-agent-task" in p)
    task_dir = project_relative(Path(*parts[:i + 1]))  # the project's own: named as the commands name it
    if task_dir in TINY_TASK_BUILDERS:  # another folder's .cache/tiny-task is not where those commands build
        return f"the tiny task {task_dir} is built by {TINY_TASK_BUILDERS[task_dir]}; run it once"
    return (f"the tiny task {task_dir} is built by `python tools/build_tiny_model.py {task_dir} --seed 0`; "
            "run it once")


def check_data_files(cfg: DictConfig, errors: list[str]) -> None:
    paths = [("data.train_path", cfg.data.train_path)] if cfg.data.train_path else []
    paths += [(f"data.eval_paths[{i}]", p) for i, p in enumerate(cfg.data.eval_paths)]
    # a file, or a directory: a `datasets` save_to_disk or a directory of data files (data/sources.py)
    missing = [(k, p) for k, p in paths if not Path(os.path.expanduser(str(p))).exists()]
    if missing:
        shown = ", ".join(f"{k} = {p!r}" for k, p in missing[:3]) + (f" and {len(missing) - 3} more"
                                                                       if len(missing) > 3 else "")
        errors.append(f"no such file: {shown}; {missing_file_hint(cfg, missing[0][0], str(missing[0][1]), 'data file')}")
