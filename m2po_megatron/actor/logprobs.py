"""Per-token log-probs and entropy from vocabulary-parallel logits, without full-vocabulary fp32 copies.

The logits-level form (and the math shared with actor.fused_logprobs, which the actor uses: it computes the
logits chunk by chunk from the final hidden states, so no [S, V] tensor exists at all). Here each
tensor-parallel rank holds the logits of its slice of the vocabulary ([S, V/tp]). One autograd function
reads the rows that predict response tokens in chunks of a fixed byte budget, in fp32, and keeps per row only
a local max, the sum of exp, the sum of exp * logit and the target's logit. Two all-reduces over the
tensor-parallel group (max, then the three sums rescaled to the global max) give

    log p(target) = l_t - m - log Z,   H = log Z - sum_j exp(l_j - m) (l_j - m) / Z,   Z = sum_j exp(l_j - m)

so the vocabulary is never gathered on one rank. Both outputs carry a gradient. Backward recomputes the
softmax chunk by chunk from the saved logits, the saved log-normaliser and the saved entropy (all global after
the all-reduces, so each rank's columns need nothing from the others):

    d log p(t) / d l_j = [j == t] - p_j,   d H / d l_j = -p_j (log p_j + H)

The entropy term is computed only when the entropy reached the loss (its incoming gradient is not None: the
function does not materialise missing gradients as zeros), by blocks of ENTROPY_BLOCK vocabulary columns, so
it adds one [rows, ENTROPY_BLOCK] fp32 temporary, not another chunk. Extra memory: the chunk temporaries (a
few x `chunk_bytes`) and, in backward, the logits' gradient in the logits' dtype.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .packing import to_device

CHUNK_BYTES = 64 * 1024**2  # fp32 bytes of one chunk of logit rows
ENTROPY_BLOCK = 16384  # vocabulary columns per exp temporary of the entropy's gradient


def _chunks(n: int, vocab: int, chunk_bytes: int):
    rows = max(1, int(chunk_bytes) // (4 * max(1, vocab)))
    for s in range(0, n, rows):
        yield s, min(n, s + rows)


def tp_size_rank(group) -> tuple[int, int]:
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def local_targets(target: torch.Tensor, vp: int, tp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's column of each target, 0 where another rank holds it; whether this rank holds it)."""
    local = target - tp_size_rank(tp_group)[1] * vp
    owned = (local >= 0) & (local < vp)
    return torch.where(owned, local, torch.zeros_like(local)), owned


def chunk_partials(x: torch.Tensor, local: torch.Tensor, m: torch.Tensor, sums: torch.Tensor) -> None:
    """One chunk of fp32 logit rows x [c, V/tp] (overwritten) -> its local max into m [c] and the three
    partial sums into sums [3, c] (views of the full-row buffers)."""
    mc = x.max(dim=-1).values
    x.sub_(mc.unsqueeze(-1))
    m.copy_(mc)
    sums[2].copy_(x.gather(-1, local.unsqueeze(-1)).squeeze(-1))
    ex = x.exp()
    sums[0].copy_(ex.sum(-1))
    sums[1].copy_(ex.mul_(x).sum(-1))


def combine_partials(m: torch.Tensor, sums: torch.Tensor, owned: torch.Tensor, tp_group):
    """Per-row partials of this rank's vocabulary slice -> (log p(target), entropy, log-normaliser) over the
    whole vocabulary. m [R]: local max; sums [3, R]: sum exp(l - m), sum exp(l - m) (l - m), l_t - m (any
    value where not owned). Two all-reduces over the tensor-parallel group (max, then the rescaled sums)."""
    sums[2] = torch.where(owned, sums[2], torch.zeros_like(sums[2]))
    if tp_size_rank(tp_group)[0] > 1:  # move every rank's partial sums to the global max, then add them up
        g = m.clone()
        dist.all_reduce(g, op=dist.ReduceOp.MAX, group=tp_group)
        shift = m - g
        scale = torch.exp(shift)
        sums[1] = scale * (sums[1] + shift * sums[0])
        sums[0] = scale * sums[0]
        sums[2] = torch.where(owned, sums[2] + shift, sums[2])
        dist.all_reduce(sums, group=tp_group)
        m = g
    log_z = torch.log(sums[0])
    return sums[2] - log_z, log_z - sums[1] / sums[0], m + log_z


def chunk_logit_grad(x: torch.Tensor, lse: torch.Tensor, local: torch.Tensor, owned: torch.Tensor,
                     g: torch.Tensor | None, ge: torch.Tensor | None, ent: torch.Tensor) -> torch.Tensor:
    """One chunk of fp32 logit rows x [c, V/tp] (overwritten and returned) -> the gradient of
    sum_r g_r log p_r(t_r) + ge_r H_r with respect to them, given the rows' global log-normaliser `lse` [c]
    and entropy `ent` [c]; g or ge None: that output is not in the loss (and costs nothing)."""
    x.sub_(lse.unsqueeze(-1))  # log p_j
    if ge is None:
        x.exp_().mul_(-g.unsqueeze(-1))
    else:  # p_j (a + b log p_j) with a = -g - ge H, b = -ge, by column blocks: exp(log p) and log p at once
        b = -ge.unsqueeze(-1)
        a = b * ent.unsqueeze(-1) if g is None else (b * ent.unsqueeze(-1)).sub_(g.unsqueeze(-1))
        for v0 in range(0, x.size(-1), ENTROPY_BLOCK):
            xb = x[:, v0:v0 + ENTROPY_BLOCK]
            pb = xb.exp()
            xb.mul_(b).add_(a).mul_(pb)
            del pb
    if g is not None:
        x.scatter_add_(-1, local.unsqueeze(-1), (g * owned).unsqueeze(-1))
    return x


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, positions, target, tp_group, chunk_bytes):
        n, vp = positions.numel(), logits.size(-1)
        local, owned = local_targets(target, vp, tp_group)
        dev = logits.device
        m = torch.empty(n, dtype=torch.float32, device=dev)
        sums = torch.zeros(3, n, dtype=torch.float32, device=dev)  # sum exp, sum exp * (l - m), l_t - m
        for s, e in _chunks(n, vp, chunk_bytes):
            chunk_partials(logits.index_select(0, positions[s:e]).float(), local[s:e], m[s:e], sums[:, s:e])
        logp, entropy, lse = combine_partials(m, sums, owned, tp_group)
        ctx.save_for_backward(logits, positions, local, owned, lse, entropy)
        ctx.chunk_bytes = chunk_bytes
        ctx.set_materialize_grads(False)  # an output outside the loss arrives as None and costs nothing
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, positions, local, owned, lse, entropy = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        if grad_logp is None and grad_entropy is None:
            return grad, None, None, None, None
        g = None if grad_logp is None else grad_logp.float()
        ge = None if grad_entropy is None else grad_entropy.float()
        for s, e in _chunks(positions.numel(), logits.size(-1), ctx.chunk_bytes):
            x = logits.index_select(0, positions[s:e]).float()
            chunk_logit_grad(x, lse[s:e], local[s:e], owned[s:e], None if g is None else g[s:e],
                             None if ge is None else ge[s:e], entropy[s:e])
            grad.index_copy_(0, positions[s:e], x.to(grad.dtype))
            del x
        return grad, None, None, None, None


def token_log_probs(logits: torch.Tensor, positions: torch.Tensor, target: torch.Tensor, tp_group=None,
                    chunk_bytes: int = CHUNK_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V/tp] (any float dtype, this rank's vocabulary slice), positions [R] distinct rows of
    `logits`, target [R] global token ids -> (log p(target) [R] fp32, entropy [R] fp32), both with gradient
    to the logits. Rows outside `positions` get a zero gradient."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [S, V/tp], got shape {tuple(logits.shape)}")
    if positions.shape != target.shape or positions.dim() != 1:
        raise ValueError(f"positions {tuple(positions.shape)} and target {tuple(target.shape)} must be equal 1-D")
    return _TokenLogProbs.apply(logits, to_device(positions, logits.device).long(),
                                to_device(target, logits.device).long(), tp_group, int(chunk_bytes))
