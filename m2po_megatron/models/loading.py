"""Loading HF weights into a live, sharded Megatron model on each rank, one tensor at a time."""
from __future__ import annotations

from typing import Any, Iterator

import torch

from m2po_megatron.models.hf_checkpoint import open_hf_source, spec_for, validate_hf_source
from m2po_megatron.models.hf_config import HFModelSpec
from m2po_megatron.models.weights import hf_names, rule_for, to_megatron_shard


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def global_named_parameters(chunk) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(name with *global* layer index, parameter) for one model chunk (this rank's pipeline stage)."""
    m = unwrap(chunk)
    for name, p in m.named_parameters():
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers."):].split(".", 1)
            layer = m.decoder.layers[int(local)].layer_number - 1  # layer_number is global and 1-based
            name = f"decoder.layers.{layer}.{rest}"
        yield name, p


@torch.no_grad()
def load_hf_weights(model_chunks: Any, source: Any, hf_config: Any = None, *, validate: bool = True) -> int:
    """Copy HF weights into this rank's Megatron model chunk(s); returns the number of parameters filled.

    model_chunks: a GPTModel (possibly wrapped) or a list of them (virtual pipeline). source: a directory of
    safetensors (sharded with index or not), a transformers model, or a {name: tensor} dict. hf_config defaults
    to the source's config. Every rank calls this with the same source; each reads only what it holds.
    Raises CheckpointMismatchError before touching the model when tensors are missing/unexpected/misshaped."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    src = open_hf_source(source)
    try:
        return _load(chunks, src, hf_config, validate)
    finally:
        if src is not source:
            src.close()


def _load(chunks: list, src, hf_config: Any, validate: bool) -> int:
    from megatron.core import parallel_state as ps

    spec: HFModelSpec = spec_for(src, hf_config)
    if validate:
        validate_hf_source(spec, src)
    tp_rank = ps.get_tensor_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    tp_size = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    n = 0
    for chunk in chunks:
        for name, p in global_named_parameters(chunk):
            rule, layer = rule_for(spec, name)
            shard = to_megatron_shard(spec, rule, [src.get(h) for h in hf_names(rule, layer)], tp_rank, tp_size)
            if tuple(shard.shape) != tuple(p.shape):
                raise ValueError(f"{name}: HF gives shard {list(shard.shape)} but the Megatron parameter is "
                                 f"{list(p.shape)} (tp_rank {tp_rank}/{tp_size})")
            p.data.copy_(shard)
            n += 1
    return n
