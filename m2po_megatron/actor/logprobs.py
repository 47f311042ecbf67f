"""Per-token log-probs and entropy from vocabulary-parallel logits.

Each tensor-parallel rank holds logits for its slice of the vocabulary. The log-prob of the target token
uses megatron-core's vocab_parallel_cross_entropy (all-reduces of max, target logit and sum-exp; its own
backward), so the full vocabulary is never gathered on one rank. The entropy (a diagnostic, no gradient)
uses the same three all-reduces: H = log Z + m - sum(exp(l - m) * l) / Z.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def vocab_parallel_log_probs(logits: torch.Tensor, target: torch.Tensor, tp_group=None) -> torch.Tensor:
    """logits [N, V/tp] (any float dtype), target [N] global token ids -> log p(target) [N] in fp32, with
    gradient. The input is copied first: megatron's kernel works in place on its argument."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # The kernel expects [s, b, v]; one fake batch dimension.
    nll = vocab_parallel_cross_entropy(logits.float().clone().unsqueeze(1), target.unsqueeze(1), tp_group=tp_group)
    return -nll.squeeze(1)


@torch.no_grad()
def vocab_parallel_entropy(logits: torch.Tensor, tp_group=None) -> torch.Tensor:
    """logits [N, V/tp] -> entropy of the full softmax [N] in fp32 (no gradient)."""
    x = logits.detach().float()
    m = x.max(dim=-1).values
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    e = torch.exp(x - m.unsqueeze(-1))
    sums = torch.stack([e.sum(-1), (e * x).sum(-1)])
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sums, group=tp_group)
    z, s1 = sums[0], sums[1]
    return torch.log(z) + m - s1 / z
