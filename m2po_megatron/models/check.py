"""Is a directory a complete HF model of the expected shape? The check `m2po download` runs after fetching (and
on a directory that is already there): config.json against the recipe's shipped config, the safetensors files
against the tensors the Megatron converter reads, and the tokenizer. Headers only: no weight is loaded."""
from __future__ import annotations

import os
from typing import Any, Optional

from m2po_megatron.models.hf_checkpoint import CheckpointMismatchError, open_hf_source, validate_hf_source
from m2po_megatron.models.hf_config import HFModelSpec, UnsupportedModelError, read_hf_config

# The HFModelSpec fields that decide the architecture and every weight's shape: a downloaded config.json must
# agree with the recipe's model.hf_config on all of them (rope or eps differences would not change the layout,
# but none of these may differ without the recipe's parallel layout and memory estimate being wrong).
SHAPE_FIELDS = ("architecture", "num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "intermediate_size", "tie_word_embeddings", "num_experts",
                "num_experts_per_tok", "moe_intermediate_size")


class WeightsError(ValueError):
    """A model directory is incomplete or is not the model the recipe expects; the message names the fix."""


def shape_mismatches(have: HFModelSpec, want: HFModelSpec) -> list[str]:
    """'field: downloaded X, expected Y' for each shape field on which the two configs differ."""
    return [f"{f}: downloaded {getattr(have, f)!r}, expected {getattr(want, f)!r}" for f in SHAPE_FIELDS
            if getattr(have, f) != getattr(want, f)]


def weight_problems(model_dir: str, reference: Any = None) -> list[str]:
    """Every problem found in model_dir (empty: complete). `reference` (a config.json path, dir or dict, or
    None) is the config the recipe was planned for."""
    if not os.path.isdir(model_dir):
        return [f"{model_dir} does not exist"]
    try:
        spec = read_hf_config(model_dir)
    except FileNotFoundError:
        return [f"no config.json in {model_dir}"]
    except (UnsupportedModelError, ValueError) as e:  # ValueError: config.json is not JSON
        return [f"{os.path.join(model_dir, 'config.json')}: {e}"]
    problems = []
    if reference is not None:
        bad = shape_mismatches(spec, read_hf_config(reference))
        if bad:
            problems.append(f"config.json is not the model the recipe's model.hf_config describes ({'; '.join(bad)})")
    try:
        # the index's files exist and hold the tensors it names; then the converter's tensor list (models.weights)
        with open_hf_source(model_dir) as src:
            validate_hf_source(spec, src)
    except (FileNotFoundError, CheckpointMismatchError) as e:
        problems.append(f"weights: {e}")
    tok = tokenizer_problem(model_dir)
    if tok:
        problems.append(tok)
    return problems


def tokenizer_problem(model_dir: str) -> Optional[str]:
    """None when AutoTokenizer loads model_dir from its local files alone, else why not."""
    # transformers falls back to other sources when a directory has no tokenizer file at all; ask for one first
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any(os.path.isfile(os.path.join(model_dir, n)) for n in names):
        return f"tokenizer: none of {', '.join(names)} in {model_dir}"
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... for a broken tokenizer
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"tokenizer: AutoTokenizer cannot load {model_dir} ({first})"
    if not tok("1 + 1")["input_ids"]:
        return f"tokenizer: the tokenizer in {model_dir} turns text into no tokens"
    return None
