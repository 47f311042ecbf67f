"""Loading HF weights into a live, sharded Megatron model on each rank, one tensor at a time."""
from __future__ import annotations

import re
from typing import Any, Iterator

import torch

from m2po_megatron.models.hf_checkpoint import open_hf_source, spec_for, validate_hf_source
from m2po_megatron.models.hf_config import HFModelSpec
from m2po_megatron.models.weights import EXPERT, hf_names, rule_for, to_megatron_shard

# models.grouped_experts' parameters: all local experts of a layer in one 3-D tensor
GROUPED = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight$")


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def global_named_parameters(chunk) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(name with *global* layer and expert indices, parameter) for one model chunk (this rank's pipeline stage;
    with expert parallelism, this rank's experts: local expert j of EP rank r is expert r x local + j). Grouped
    experts (models.grouped_experts) come as one view per expert, named as TEGroupedMLP's."""
    m = unwrap(chunk)
    first_expert = None
    for name, p in m.named_parameters():
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers."):].split(".", 1)
            layer = m.decoder.layers[int(local)].layer_number - 1  # layer_number is global and 1-based
            g = GROUPED.match(rest) if p.dim() == 3 else None
            if g:  # models.grouped_experts: one [local experts, out, in] tensor; each expert under TE's name
                if first_expert is None:
                    first_expert = _first_local_expert(m.decoder.layers[int(local)].mlp)
                for j in range(p.shape[0]):
                    yield f"decoder.layers.{layer}.mlp.experts.{g.group(1)}.weight{first_expert + j}", p[j]
                continue
            x = EXPERT.match(rest)
            if x:
                if first_expert is None:
                    first_expert = _first_local_expert(m.decoder.layers[int(local)].mlp)
                if x.group(1) is not None:
                    rest = f"mlp.experts.local_experts.{first_expert + int(x.group(1))}.{x.group(2)}.weight"
                else:
                    rest = f"mlp.experts.{x.group(3)}.weight{first_expert + int(x.group(4))}"
            name = f"decoder.layers.{layer}.{rest}"
        yield name, p


def _first_local_expert(moe_layer) -> int:
    """The global index of this rank's first expert (megatron's MoELayer keeps it as local_expert_indices)."""
    return int(moe_layer.local_expert_indices[0])


def shard_position(rule) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel split a rule's parameter follows on this rank: the expert
    tensor-parallel group for experts, the tensor-parallel group otherwise; (0, 1) without parallel state."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1
    if rule.expert:
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


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
    spec: HFModelSpec = spec_for(src, hf_config)
    if validate:
        validate_hf_source(spec, src)
    n = 0
    for chunk in chunks:
        for name, p in global_named_parameters(chunk):
            rule, layer = rule_for(spec, name)
            tp_rank, tp_size = shard_position(rule)
            shard = to_megatron_shard(spec, rule, [src.get(h) for h in hf_names(rule, layer)], tp_rank, tp_size)
            if tuple(shard.shape) != tuple(p.shape):
                raise ValueError(f"{name}: HF gives shard {list(shard.shape)} but the Megatron parameter is "
                                 f"{list(p.shape)} (tp_rank {tp_rank}/{tp_size})")
            p.data.copy_(shard)
            n += 1
    return n
