"""A run's inputs, read and checked before Ray starts: the tokenizer and the training prompts and eval sets
(a bad file is a ConfigError naming the field, file and row)."""
from __future__ import annotations

from omegaconf import DictConfig


def load_tokenizer(cfg: DictConfig):
    from transformers import AutoTokenizer

    from m2po_megatron.config import ConfigError

    ref = cfg.model.tokenizer or cfg.model.hf_path
    try:
        return AutoTokenizer.from_pretrained(ref)
    except (OSError, ValueError) as e:
        key = "model.tokenizer" if cfg.model.tokenizer else "model.hf_path"
        raise ConfigError(f"{key} = {ref!r}: no tokenizer could be loaded ({str(e).splitlines()[0]}); give a "
                          f"directory with tokenizer files (or set model.tokenizer)") from None


def load_data(cfg: DictConfig, tokenizer, require_label: bool = True):
    """The training rows (a PromptStream) and eval sets, as TaskRows (data/rows.py): every row read, checked
    and rendered to the exact tokens the model sees before Ray starts, training and evaluation alike.
    `require_label`: the reward needs data.label_key in every row (math_verify does). A bad file or row is a
    ConfigError naming the option, file, line or row and column."""
    from m2po_megatron.config import ConfigError
    from m2po_megatron.data.prompts import PromptStream
    from m2po_megatron.data.rows import DataError, load_task_rows
    from m2po_megatron.eval.benchmarks import EvalSet, eval_set_names

    d = cfg.data
    if not d.train_path:
        raise ConfigError("data.train_path is not set; point it at your rows (docs/data.md) or prepare data with "
                          "`m2po prepare-data`")

    def rows_of(path: str, split: str, key: str):
        try:
            return load_task_rows(path, d, tokenizer, split=split, require_label=require_label, key=key)
        except DataError as err:  # bad input: exit 2 before Ray starts (the message names option, file and row)
            raise ConfigError(str(err)) from None

    train = rows_of(d.train_path, d.train_split, "data.train_path")
    e = cfg.eval
    eval_sets = []
    try:
        names = eval_set_names(list(d.eval_paths))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    for i, (path, name) in enumerate(zip(d.eval_paths, names)):
        rows = rows_of(path, d.eval_split, f"data.eval_paths[{i}]")
        try:
            eval_sets.append(EvalSet(name, rows, e.n_samples_overrides.get(name, e.n_samples)))
        except ValueError as err:
            raise ConfigError(f"data.eval_paths[{i}]: {err}") from None
    return PromptStream(train, d.shuffle_seed), eval_sets
