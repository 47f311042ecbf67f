"""GRPO group-normalised advantages (one scalar per sequence)."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def grpo_advantages(
    rewards: Tensor,
    group_size: int | None = None,
    group_ids: Tensor | None = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """A_i = (R_i - mean_g R) / (std_g R + eps) within each prompt group g (std unbiased, as in GRPO/verl).

    Args:
        rewards: [num_seqs] scalar reward per sequence (sum token-level rewards first).
        group_size: sequences of one prompt are contiguous, `group_size` each (e.g. 8 rollouts per prompt).
        group_ids: alternatively, an integer id per sequence [num_seqs]; members need not be contiguous.
        norm_by_std: False gives Dr.GRPO's mean-only centring.
        eps: added to the std (groups whose rewards are all equal get advantage 0).

    Returns:
        float32 (or float64 for float64 rewards) advantages [num_seqs]. Broadcast to tokens with
        `adv[:, None]` for padded [B, T] tensors or `adv[seq_ids]` for flat ones. A group of a single
        sequence gets advantage 0 (no baseline exists; verl would return the raw reward instead).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_seqs], got shape {tuple(rewards.shape)}; sum token rewards first")
    if (group_size is None) == (group_ids is None):
        raise ValueError("pass exactly one of group_size (contiguous groups) or group_ids")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contains NaN or inf; check the reward function's output")
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    r = rewards.to(dtype)
    n = r.numel()
    if group_ids is None:
        if not isinstance(group_size, int) or group_size < 1 or n % group_size:
            raise ValueError(f"group_size={group_size!r} must be a positive int dividing len(rewards)={n}")
        gid = torch.arange(n, device=r.device) // group_size
    else:
        if tuple(group_ids.shape) != (n,):
            raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, expected ({n},) like rewards")
        gid = torch.unique(group_ids, return_inverse=True)[1]
    num_groups = int(gid.max()) + 1 if n else 0
    count = torch.zeros(num_groups, dtype=dtype, device=r.device).index_add_(0, gid, torch.ones_like(r))
    mean = torch.zeros_like(count).index_add_(0, gid, r) / count
    centred = r - mean[gid]
    if not norm_by_std:
        return centred
    sq = torch.zeros_like(count).index_add_(0, gid, centred.square())
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return centred / (std[gid] + eps)
