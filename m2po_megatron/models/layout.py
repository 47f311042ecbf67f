"""Whether a model can be split into a parallel layout: the one check used by the config validation
(before anything starts) and by the model builder, checkpoint conversion and the actor (pure Python)."""
from __future__ import annotations

from typing import Optional


def layout_errors(*, num_attention_heads: Optional[int], num_key_value_heads: Optional[int],
                  num_layers: Optional[int], intermediate_size: Optional[int] = None,
                  vocab_size: Optional[int] = None, tp: int = 1, pp: int = 1, vpp: Optional[int] = None,
                  prefix: str = "") -> list[str]:
    """One message per model dimension that the tensor / pipeline (x virtual) sizes do not divide; a dimension
    given as None (unknown) is skipped. `prefix` names where the sizes come from (e.g. "parallel.")."""
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
    return errors


def validate_layout(spec, tp: int, pp: int, vpp: int | None = None) -> None:
    """Raise ValueError naming every dimension of `spec` (an HFModelSpec) that the parallel sizes do not divide."""
    errors = layout_errors(num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
                           num_layers=spec.num_layers, intermediate_size=spec.intermediate_size,
                           vocab_size=spec.vocab_size, tp=tp, pp=pp, vpp=vpp)
    if errors:
        raise ValueError("; ".join(errors))
