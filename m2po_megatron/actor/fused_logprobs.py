"""The output layer fused with the per-token log-prob and entropy: no [S, V] logits or gradient exist.

megatron's output layer would turn the final hidden states [S, H] into [S, V/tp] logits (bf16 on GPU) for
every row of the packed micro-batch, and their gradient would be another [S, V/tp]: about 18 GB at 30,000
tokens and Qwen's 151,936-token vocabulary. Only the rows that predict a response token (the micro-batch's
`logprob_positions`) need logits at all, and only a few numbers per row survive the softmax. So here, per
chunk of those rows:

  forward   logits_c = h_c @ W^T (W: this rank's vocabulary slice [V/tp, H] of the ColumnParallelLinear
            output layer, or the tied embedding), then the partials of actor.logprobs (local max, sum exp,
            sum exp x logit, target logit) in fp32 and the same two all-reduces over the tensor-parallel group;
  backward  logits_c recomputed, dlogits_c = g ([j == t] - p_j) - g_H p_j (log p_j + H) (g, g_H: the
            incoming gradients of the log-prob and the entropy; actor.logprobs.chunk_logit_grad),
            grad_h_c = dlogits_c @ W and grad_W += dlogits_c^T @ h_c; grad_h all-reduced over the
            tensor-parallel group (each rank holds the part of the gradient from its vocabulary slice), as
            ColumnParallelLinear's input gradient is. The log-normaliser and H are global after the forward's
            all-reduces and saved, so each rank's columns of dlogits need nothing from the other ranks.

Precision: the GEMMs run in the parameters' dtype (cuBLAS and the CPU accumulate bf16 products in fp32),
softmax and every sum in fp32. That is what megatron's output layer followed by actor.logprobs computed
(bf16 logits rounded once, then fp32), so the log-probs do not change; an fp32-output GEMM would need an fp32
copy of W ([V/tp, H]) or the CUDA-only `out_dtype` matmul. grad_W is summed over chunks in an fp32
[V/tp, H] buffer (one rounding per chunk and vocabulary block, not a running bf16 sum) and handed to
autograd, which casts it to the weight's dtype as megatron's own output layer's single GEMM would round it:
backward holds 6 bytes per weight element in bf16 (4 in fp32), against 4 bytes per logit before. Rows not in `positions` get a
zero hidden gradient (index_select's backward).

Both outputs carry a gradient: the entropy is the actor's metric, and the loss's bonus with
`algo.entropy_coeff`. An output left out of the loss arrives in backward as None (missing gradients are not
materialised as zeros), and then costs nothing; the entropy's term adds, per chunk, one fp32 temporary of
[rows, ENTROPY_BLOCK] (actor.logprobs), not another chunk, and backward keeps H (4 bytes a row).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .logprobs import chunk_logit_grad, chunk_partials, combine_partials, local_targets, tp_size_rank
from .packing import to_device

CHUNK_BYTES = 256 * 1024**2  # fp32 bytes of one chunk of logit rows (~440 rows of a 151,936 vocabulary)
VOCAB_BLOCK = 16384  # rows of the output weight per bf16 gradient product (its temporary: VOCAB_BLOCK x H)


def chunk_rows(vocab_local: int, chunk_bytes: int | None = None) -> int:
    """Rows per chunk: `chunk_bytes` (default CHUNK_BYTES, read at the call) of fp32 logits of this rank's
    vocabulary slice (at least one row)."""
    return max(1, int(CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // (4 * max(1, int(vocab_local))))


def _chunks(n: int, rows: int):
    for s in range(0, n, rows):
        yield s, min(n, s + rows)


class _FusedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, target, tp_group, rows):
        n, vp = h.size(0), weight.size(0)
        local, owned = local_targets(target, vp, tp_group)
        m = torch.empty(n, dtype=torch.float32, device=h.device)
        sums = torch.zeros(3, n, dtype=torch.float32, device=h.device)
        for s, e in _chunks(n, rows):
            chunk_partials((h[s:e] @ weight.t()).float(), local[s:e], m[s:e], sums[:, s:e])
        logp, entropy, lse = combine_partials(m, sums, owned, tp_group)
        ctx.save_for_backward(h, weight, local, owned, lse, entropy)
        ctx.tp_group, ctx.rows = tp_group, rows
        ctx.set_materialize_grads(False)  # an output outside the loss arrives as None and costs nothing
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        h, weight, local, owned, lse, entropy = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g = None if grad_logp is None else grad_logp.float()
        ge = None if grad_entropy is None else grad_entropy.float()
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        for s, e in _chunks(h.size(0), ctx.rows):
            hc = h[s:e]
            p = chunk_logit_grad((hc @ weight.t()).float(), lse[s:e], local[s:e], owned[s:e],
                                 None if g is None else g[s:e], None if ge is None else ge[s:e], entropy[s:e])
            dl = p.to(weight.dtype)
            del p
            if want_h:
                torch.mm(dl, weight, out=grad_h[s:e])
            if want_w:
                if dl.dtype == torch.float32:
                    grad_w.addmm_(dl.t(), hc)
                else:  # bf16 GEMMs (fp32 accumulation inside) by blocks of the vocabulary, summed in fp32
                    for v0 in range(0, grad_w.size(0), VOCAB_BLOCK):
                        grad_w[v0:v0 + VOCAB_BLOCK].add_(dl[:, v0:v0 + VOCAB_BLOCK].t() @ hc)
            del dl
        if want_h and tp_size_rank(ctx.tp_group)[0] > 1:
            dist.all_reduce(grad_h, group=ctx.tp_group)
        return grad_h, grad_w, None, None, None


def fused_token_log_probs(hidden: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor,
                          target: torch.Tensor, tp_group=None,
                          chunk_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [S, H] (the final norm's output, every row of the micro-batch on this rank), weight [V/tp, H]
    (this rank's vocabulary slice of the output layer), positions [R] distinct rows of `hidden`, target [R]
    global token ids -> (log p(target) [R] fp32, entropy [R] fp32), both with gradient to hidden and weight
    (entropy: in nats, over the whole vocabulary, every tensor-parallel rank holding the same values).
    Equal to token_log_probs(hidden @ weight.T, positions, target) without building the logits."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.size(1) != weight.size(1):
        raise ValueError(f"hidden must be [S, H] and weight [V/tp, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) and the output weight ({weight.dtype}) must share a dtype, "
                         f"as megatron's output layer requires")
    if positions.shape != target.shape or positions.dim() != 1:
        raise ValueError(f"positions {tuple(positions.shape)} and target {tuple(target.shape)} must be equal 1-D")
    pos = to_device(positions.long(), hidden.device)
    return _FusedLogProbs.apply(hidden.index_select(0, pos), weight, to_device(target.long(), hidden.device),
                                tp_group, chunk_rows(weight.size(0), chunk_bytes))


def output_layer_log_probs(hidden_states: torch.Tensor, output_layer, output_weight, positions: torch.Tensor,
                           target: torch.Tensor, tp_group=None, chunk_bytes: int | None = None):
    """GPTModel's last stage: decoder output [S, 1, H] (sequence-split under sequence parallelism) and its
    output layer (a ColumnParallelLinear; `output_weight` the tied embedding's weight or None) -> the fused
    log-probs. Under sequence parallelism the rows are gathered first as the output layer would gather them;
    the gather's backward only splits, because fused_token_log_probs already sums the hidden gradient over
    the tensor-parallel group."""
    if hidden_states.dim() != 3 or hidden_states.size(1) != 1:
        raise ValueError(f"hidden_states must be [S, 1, H] (one packed row), got {tuple(hidden_states.shape)}")
    weight = output_weight if output_weight is not None else output_layer.weight
    h = hidden_states[:, 0]
    if getattr(output_layer, "sequence_parallel", False):
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False, group=tp_group)
    return fused_token_log_probs(h, weight, positions, target, tp_group, chunk_bytes)
