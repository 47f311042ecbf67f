"""Model FLOPs of training, the count `m2po plan`'s trainer cost (plan/costs.py) prices and the GPU check's MFU
divides by the device's peak: one formula, here.

Per token, forward and backward: 6 x the matmul parameters a token goes through (Kaplan et al. 2020's 6 N,
with the logit layer counted and the input embedding's lookup not, as Narayanan et al. 2021 count it), plus
causal attention's score and context matmuls (PaLM, Chowdhery et al. 2022, appendix B: 12 x layers x heads x
head_dim x context, halved for the causal mask). MFU is these model FLOPs over seconds over the dense peak:
work the hardware does beyond them (activation recompute, a forward-only log-prob pass, padding) is not
counted, so it lowers MFU instead of hiding in it. `shape` is a models.memory.ModelShape."""
from __future__ import annotations

from typing import Iterable

__all__ = ["FORWARD_ONLY_SHARE", "attention_flops", "inactive_expert_params", "matmul_params", "train_flops",
           "train_flops_per_token"]

FORWARD_ONLY_SHARE = 1 / 3  # a forward-only pass (log-probs, a reference model): 2 of the 6 N per token


def matmul_params(shape, params: int) -> int:
    """N_mm: the parameters FLOPs count. The input embedding is a lookup; the output projection is a matmul,
    also when it shares the embedding's table (tied: `params` counts that table once, as the projection)."""
    return params if shape.tied else params - shape.vocab * shape.hidden


def inactive_expert_params(shape) -> int:
    """The routed experts' parameters a token does not go through: (E - k) of each MoE layer's E experts
    (0 for a dense model). Training and decode FLOPs count the active parameters, memory and the weight sync
    all of them."""
    experts = getattr(shape, "experts", 0)
    return shape.layers * (experts - shape.topk) * 3 * shape.hidden * shape.expert_ffn if experts else 0


def attention_flops(shape, context: float) -> float:
    """Attention's score and context matmuls per token, forward and backward, causal: 12 x layers x heads x
    head_dim x context / 2."""
    return 12 * shape.layers * shape.heads * shape.head_dim * context / 2


def train_flops_per_token(shape, params: int, context: float) -> float:
    """Forward and backward FLOPs of one token of a sequence of `context` tokens: 6 x the active matmul
    parameters + causal attention."""
    return 6 * (matmul_params(shape, params) - inactive_expert_params(shape)) + attention_flops(shape, context)


def train_flops(shape, params: int, seq_lens: Iterable[int]) -> float:
    """Forward and backward FLOPs of a batch of sequences (packed or padded: each attends within itself;
    padding is not counted)."""
    return sum(n * train_flops_per_token(shape, params, n) for n in seq_lens)
