"""The gradient norm of an optimizer update with one fused multi-tensor norm and one host read.

Without Transformer Engine or Apex (the H200 image has neither, and the CPU), megatron-core 0.19.2 falls
back to `megatron.core.utils.local_multi_tensor_l2_norm`: one `torch.norm` per gradient tensor, then
`torch.tensor([...])` of those 0-d device tensors (a device read per tensor), `float()` of their norm (one
more) and `.item()` after the all-reduce (one more). `fused_grad_norm` computes the same number with
`torch._foreach_norm` (one multi-tensor kernel), one stack/norm and one read after the all-reduce.

Where TE or Apex is installed megatron's own fused norm is kept (`use_fused_grad_norm` leaves it).
Hook: megatron's ChainedOptimizer.step() asks `self.get_grad_norm()` for the norm it logs, clips by and
returns; `use_fused_grad_norm` sets that method on the optimizer object to ours, over the same gradients
(`get_grads_for_grad_norm()`: megatron's own rule that leaves out shared and tensor-parallel duplicate
parameters) and the same reduction group (`get_grad_stats_parallel_group()`). With mixture of experts the
chain has an expert optimizer whose group differs (megatron sums the squared norms of the chained
optimizers); each group's squares are summed on the device and reduced over its group, and the one host
read comes after. It returns a float, as the fallback does, because megatron's clip without TE only takes a
float.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from m2po_megatron.infra.device import device


def _squares(grads: list[torch.Tensor], group=None) -> torch.Tensor:
    """[1] sum of squares of `grads` over `group`, on the device (no host read)."""
    if grads:
        norms = torch._foreach_norm(grads)
        total = torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1) ** 2
    else:
        total = torch.zeros(1, dtype=torch.float32, device=device())
    if dist.is_initialized():
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def fused_grad_norm(grads: list[torch.Tensor], group=None) -> float:
    """L2 norm of `grads` (this rank's, fp32) summed in squares over `group`, as megatron's
    get_grad_norm_fp32(norm_type=2): the norm of the per-tensor norms, squared, all-reduced, then rooted."""
    return float(_squares(grads, group).item()) ** 0.5


def megatron_norm_is_fallback() -> bool:
    """Whether megatron-core computes grad norms with its per-tensor fallback (neither TE nor Apex found)."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    return clip_grads.l2_norm_impl is local_multi_tensor_l2_norm


def use_fused_grad_norm(optimizer, force: bool = False) -> bool:
    """Make `optimizer` (megatron's ChainedOptimizer or one of its optimizers) compute its grad norm with
    fused_grad_norm, where megatron would use its per-tensor fallback (or `force`); with TE or Apex megatron's
    own multi-tensor norm stays (TE's even keeps the norm on the device for clipping). Returns whether it
    was set."""
    if not (force or megatron_norm_is_fallback()):
        return False
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    groups: list = []  # [(group, [optimizers])] in chain order: dense, and with MoE the experts'
    for sub in subs:
        g = sub.get_grad_stats_parallel_group()
        for have, members in groups:
            if have is g:
                members.append(sub)
                break
        else:
            groups.append((g, [sub]))

    @torch.no_grad()
    def get_grad_norm():
        totals = [_squares([x for s in members for x in s.get_grads_for_grad_norm()], g) for g, members in groups]
        return float(torch.cat(totals).sum().item()) ** 0.5

    optimizer.get_grad_norm = get_grad_norm
    return True
