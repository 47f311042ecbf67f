"""A run's inputs, read and checked before Ray starts: the tokenizer and the training prompts and eval sets
(a bad file is a ConfigError naming the field, file and row)."""
from __future__ import annotations

from pathlib import Path

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


def load_data(cfg: DictConfig, tokenizer):
    """The training prompts and eval sets, read and checked (rows, prompt lengths) before Ray starts, each
    prompt the exact text the model sees (data.prompt_template and the chat template applied the same way
    to both; see data.prepare.final_prompts). A bad file is a ConfigError naming the field, file and row."""
    from m2po_megatron.config import ConfigError
    from m2po_megatron.data.prepare import final_prompts
    from m2po_megatron.eval.benchmarks import EvalSet
    from m2po_megatron.data.prompts import PromptStream, Tokenize, load_prompt_rows

    d = cfg.data
    if not d.train_path:
        raise ConfigError("data.train_path is not set; prepare data with `m2po prepare-data`")
    tokenize = Tokenize(tokenizer, d.max_prompt_len)
    files = [("data.train_path", d.train_path)]
    files += [(f"data.eval_paths[{i}]", p) for i, p in enumerate(d.eval_paths)]
    loaded = []
    for key, path in files:
        try:
            rows = final_prompts(load_prompt_rows(path), template=d.prompt_template, tokenizer=tokenizer,
                                 apply_chat_template=d.apply_chat_template, source=path)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None
        for row in rows:
            try:
                tokenize(row["prompt"])
            except Exception as e:  # noqa: BLE001 - a tokenizer may fail in many ways on odd text
                raise ConfigError(f"{key}: {path}: row {row['id']}: {e}") from None
        loaded.append(rows)
    try:
        prompts = PromptStream(loaded[0], d.shuffle_seed)
        e = cfg.eval
        eval_sets = []
        for path, rows in zip(d.eval_paths, loaded[1:]):
            name = Path(path).name.split(".")[0]
            eval_sets.append(EvalSet(name, rows, e.n_samples_overrides.get(name, e.n_samples)))
    except ValueError as e:
        raise ConfigError(f"data: {e}") from None
    return prompts, eval_sets
