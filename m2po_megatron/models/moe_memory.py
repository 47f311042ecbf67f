"""The mixture-of-experts terms of the per-GPU memory estimate (models/memory.py) and of the parameter counts:
what megatron-core's MoE layer (top-k router, all-to-all token dispatcher, SequentialMLP / TEGroupedMLP
experts, as models/builder.moe_kwargs configures them) holds per token, read from megatron-core 0.19's
transformer/moe sources. Pure arithmetic.

Routed token copies. A rank's micro-batch of T tokens enters each MoE layer as T / TP tokens under sequence
parallelism (megatron-core trains MoE with TP > 1 only with it), and each token sends k copies of its hidden
state. The expert-parallel group spans data-parallel replicas that each bring their own micro-batch, so with a
balanced router a rank *receives* as many copies as it sends: T x k / SP, whatever EP is (EP only decides how
many experts share them); the experts' all-gather over the expert-tensor-parallel group multiplies them by ETP.
The real count on one rank varies with the routing; MOE_IMBALANCE scales the balanced expectation.
"""
from __future__ import annotations

from typing import Optional

# The busiest rank's routed tokens over the balanced expectation. 1.0: the balanced expectation itself (what
# m2po rehearse traces with its balanced routing map); a run whose routing/load_max_over_mean metric shows
# skew can raise it to budget for the busiest expert-parallel rank.
MOE_IMBALANCE = 1.0
REPLAY_MODES = ("none", "r2", "r3")


def expert_layer_params(s) -> int:
    """One layer's routed experts: E SwiGLU MLPs of gate, up and down projections (H x F each)."""
    return s.experts * 3 * s.hidden * s.expert_ffn


def router_params(s) -> int:
    """One layer's router weight [E, H] (replicated on every rank)."""
    return s.experts * s.hidden


def routed_copies(s, tp: int, sequence_parallel: bool, etp: int) -> float:
    """Routed token copies one rank's experts process per token of its micro-batch (module docstring)."""
    return s.topk * etp / (tp if sequence_parallel else 1) * MOE_IMBALANCE


def moe_saved_elements(s, tp: int, sequence_parallel: bool, etp: int, fp8: bool,
                       aux_loss: bool = False) -> tuple[float, float, float]:
    """What one MoE layer's MLP (router, dispatch, experts, combine) saves for backward per token of the rank's
    micro-batch on one rank: (elements in the activation dtype, FP8 bytes, fp32 elements; an int64 index counts
    as two fp32 elements). With norm_topk_prob (Qwen3-MoE) the router's fp32 logits are not kept: topk saves its
    indices and the softmax over the k chosen logits its output."""
    rep = 1.0 / (tp if sequence_parallel else 1)  # the router sees the sequence-parallel shard
    c = routed_copies(s, tp, sequence_parallel, etp)
    f = s.expert_ffn / etp
    lin = 0.0 if fp8 else 1.0  # the experts' linear inputs: activation dtype, or an FP8 byte (TE)
    act = fp8b = f32 = 0.0
    act += s.hidden * rep  # the router's input (the pre-MLP norm's output), saved by its gating linear
    f32 += 2 * s.topk * rep  # topk's int64 indices (scatter into the routing probs shares them)
    f32 += s.topk * rep  # softmax over the k chosen logits: its fp32 output
    f32 += 2 * 2 * s.topk * rep  # permute's two int64 indices: token rows (index_select) and prob slots
    if aux_loss:
        f32 += s.experts * rep  # the aux loss's softmax over all experts (fp32)
    # per routed copy: fc1's input (the permuted hidden state), fc1's output [2F] kept by the weighted SwiGLU
    # with the copy's fp32 routing weight, fc2's input [F]
    act += c * (s.hidden * lin + 2 * f + f * lin)
    fp8b += c * (s.hidden + f) * (1 - lin)
    f32 += c
    return act, fp8b, f32


def dispatcher_state_bytes(s, tp: int, sequence_parallel: bool) -> float:
    """Per token and MoE layer, what the all-to-all dispatcher keeps as attributes until the layer's next
    forward (one micro-batch per layer, not per micro-batch in flight): the routing probs [T, E] fp32 and the
    routing map [T, E] bool."""
    return s.experts * (4 + 1) / (tp if sequence_parallel else 1)


def replay_bytes(s, tp: int, sequence_parallel: bool, routing_replay: str) -> float:
    """Per token of a micro-batch, the routing-replay data on the device (algo.routing_replay != none). The
    micro-batch's targets ([S, layers, k] int16) stay in host memory (actor/routing_replay.py); the layer being
    run copies its slice to the device as int64 and the replayed ids replace topk's indices (already counted)
    in what the router saves. So one layer's int64 copy and its bool "recorded" mask at a time."""
    if routing_replay not in REPLAY_MODES:
        raise ValueError(f"routing_replay = {routing_replay!r} must be one of {REPLAY_MODES}")
    if routing_replay == "none" or not s.experts:
        return 0.0
    return (8 * s.topk + 1) / (tp if sequence_parallel else 1)


def expert_data_parallel(tp: int, cp: int, dp: int, ep: int, etp: int) -> int:
    """The expert-data-parallel size: a pipeline stage's TP x CP x DP ranks are also ETP x EP x expert-DP."""
    ranks = tp * cp * dp
    if ranks % (ep * etp):
        raise ValueError(f"the {ranks} ranks of a pipeline stage (tensor x context x data parallel) are not "
                         f"divisible by expert_tensor_parallel_size x expert_model_parallel_size = {etp} x {ep}")
    return ranks // (ep * etp)


def check_expert_layout(s, ep: int, etp: Optional[int]) -> None:
    """ValueError naming the expert size that does not divide the model (or that a dense model cannot use)."""
    if ep < 1 or (etp is not None and etp < 1):
        raise ValueError(f"expert_model_parallel_size = {ep} and expert_tensor_parallel_size = {etp} must be >= 1")
    if not s.experts:
        if ep > 1:
            raise ValueError(f"expert_model_parallel_size = {ep} needs a mixture-of-experts model; use 1")
        return
    if s.experts % ep:
        raise ValueError(f"expert_model_parallel_size = {ep} must divide num_experts = {s.experts}")
    if etp and s.expert_ffn % etp:
        raise ValueError(f"expert_tensor_parallel_size = {etp} must divide moe_intermediate_size = {s.expert_ffn}")
