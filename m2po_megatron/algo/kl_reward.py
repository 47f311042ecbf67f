"""The KL to the reference model as a penalty in the reward (verl's algorithm.use_kl_in_reward).

Each response token's reward gets -beta x kl_t, kl_t the chosen estimator (algo/kl.py) of the behaviour
policy's log-prob against the reference model's (verl uses the actor's log-probs at the step's start, the
"old" policy; ours is the behaviour policy, whose log-probs the batch carries). GRPO's outcome advantage sums
a sequence's token rewards first, so the penalty reaches it as the sequence's reward minus beta x sum_t kl_t,
before the group normalisation: a sample that strayed further from the reference than its siblings loses
advantage. Tokens the environment inserted (a loss mask of 0) carry no penalty.

Only the fixed coefficient (verl's kl_ctrl.type=fixed) is here: the adaptive controller's state would have
to live in the run's checkpoint. Pure tensor math on the host.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from m2po_megatron.algo.advantages import grpo_advantages
from m2po_megatron.algo.kl import kl_penalty

Tensor = torch.Tensor


def penalised_advantages(rewards: Tensor, group_ids: Tensor, behav_log_probs: Sequence[Tensor],
                         ref_log_probs: Sequence[Tensor], *, coef: float, kl_type: str,
                         loss_mask: Optional[Sequence[Tensor]] = None, norm_by_std: bool = True,
                         eps: float = 1e-6) -> tuple[Tensor, dict[str, float]]:
    """GRPO advantages of `rewards` [n] less coef x each sequence's summed KL penalty, and the metrics
    kl_in_reward/kl (token mean of the penalty's KL, verl's actor/reward_kl_penalty), kl_in_reward/coef,
    kl_in_reward/reward_mean (the penalised reward's mean)."""
    if not (coef >= 0 and coef == coef and coef != float("inf")):
        raise ValueError(f"algo.kl_ctrl.kl_coef must be a finite weight >= 0, got {coef!r}")
    n = rewards.numel()
    if not (len(behav_log_probs) == len(ref_log_probs) == n):
        raise ValueError(f"{n} rewards but {len(behav_log_probs)} behaviour and {len(ref_log_probs)} reference "
                         f"log-prob sequences")
    seq_kl, token_means = [], []
    for i, (b, r) in enumerate(zip(behav_log_probs, ref_log_probs)):
        if b.shape != r.shape:
            raise ValueError(f"sequence {i}: behaviour log-probs {tuple(b.shape)} and reference {tuple(r.shape)}")
        kl = kl_penalty(b.detach().double(), r.detach().double(), kl_type)
        if loss_mask is not None:
            kl = torch.where(loss_mask[i].bool(), kl, torch.zeros_like(kl))
            count = int(loss_mask[i].bool().sum())
        else:
            count = kl.numel()
        seq_kl.append(kl.sum())
        token_means.append(float(kl.sum()) / max(count, 1))
    penalty = torch.stack(seq_kl) if seq_kl else torch.zeros(0, dtype=torch.float64)
    shaped = rewards.double() - coef * penalty
    adv = grpo_advantages(shaped, group_ids=group_ids, norm_by_std=norm_by_std, eps=eps).to(torch.float32)
    metrics = {"kl_in_reward/kl": sum(token_means) / max(n, 1), "kl_in_reward/coef": float(coef),
               "kl_in_reward/reward_mean": float(shaped.mean()) if n else 0.0}
    return adv, metrics
