"""Whether a model can be split into a parallel layout: the one check used by the config validation
(before anything starts) and by the model builder, checkpoint conversion and the actor (pure Python)."""
from __future__ import annotations

from typing import Optional


def layout_errors(*, num_attention_heads: Optional[int], num_key_value_heads: Optional[int],
                  num_layers: Optional[int], intermediate_size: Optional[int] = None,
                  vocab_size: Optional[int] = None, tp: int = 1, pp: int = 1, vpp: Optional[int] = None,
                  prefix: str = "", num_experts: Optional[int] = None, moe_intermediate_size: Optional[int] = None,
                  ep: int = 1, etp: Optional[int] = None, world_size: Optional[int] = None,
                  cp: int = 1) -> list[str]:
    """One message per model dimension that the tensor / pipeline (x virtual) / expert sizes do not divide; a
    dimension given as None (unknown) is skipped. `prefix` names where the sizes come from (e.g. "parallel.").
    For a dense model pass intermediate_size; for a MoE model num_experts and moe_intermediate_size (its
    dense intermediate_size is unused). etp (expert tensor parallel) defaults to tp, as in megatron-core.
    world_size, when known, must hold the expert layout too: (world / pp) = etp x ep x expert-data-parallel."""
    errors = []
    for what, n in (("num_attention_heads", num_attention_heads), ("num_key_value_heads", num_key_value_heads),
                    ("intermediate_size", intermediate_size), ("vocab_size", vocab_size)):
        if n and n % tp:
            errors.append(f"{what} = {n} (model config) is not divisible by {prefix}tensor_model_parallel_size "
                          f"= {tp}; use a divisor of {n}")
    stages = pp * (vpp or 1)
    if num_layers and num_layers % stages:
        errors.append(f"num_hidden_layers = {num_layers} (model config) is not divisible by {prefix}"
                      f"pipeline_model_parallel_size x virtual stages = {pp} x {vpp or 1}")
    etp = etp or tp
    if not num_experts:
        if ep > 1:
            errors.append(f"{prefix}expert_model_parallel_size = {ep} needs a mixture-of-experts model; this one "
                          "is dense: use 1")
        return errors
    if num_experts % ep:
        errors.append(f"num_experts = {num_experts} (model config) is not divisible by {prefix}"
                      f"expert_model_parallel_size = {ep}; use a divisor of {num_experts}")
    if moe_intermediate_size and moe_intermediate_size % etp:
        errors.append(f"moe_intermediate_size = {moe_intermediate_size} (model config) is not divisible by "
                      f"{prefix}expert_tensor_parallel_size = {etp}; use a divisor of {moe_intermediate_size}")
    if world_size:
        per_stage = world_size // pp if world_size % pp == 0 else None
        if per_stage is not None and per_stage % (etp * ep):
            errors.append(f"the {per_stage} ranks of a pipeline stage (world {world_size} / {prefix}"
                          f"pipeline_model_parallel_size {pp}) are not divisible by {prefix}"
                          f"expert_tensor_parallel_size x expert_model_parallel_size = {etp} x {ep}; choose "
                          "sizes whose product divides them")
    return errors


def validate_layout(spec, tp: int, pp: int, vpp: int | None = None, *, ep: int = 1, etp: int | None = None,
                    world_size: int | None = None) -> None:
    """Raise ValueError naming every dimension of `spec` (an HFModelSpec) that the parallel sizes do not divide."""
    moe = getattr(spec, "num_experts", 0) > 0
    errors = layout_errors(num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
                           num_layers=spec.num_layers, intermediate_size=None if moe else spec.intermediate_size,
                           vocab_size=spec.vocab_size, tp=tp, pp=pp, vpp=vpp,
                           num_experts=spec.num_experts if moe else None,
                           moe_intermediate_size=spec.moe_intermediate_size if moe else None, ep=ep, etp=etp,
                           world_size=world_size)
    if errors:
        raise ValueError("; ".join(errors))
