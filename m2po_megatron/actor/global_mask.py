"""The inputs of a micro-batch's loss, and M2PO's batch-level trust-region mask over a whole mini-batch.

`m2po_scope: global` decides which tokens to keep from the second moment of the log-ratios of every token of
the mini-batch on every DP rank, so the actor makes a no-grad forward at the current weights first and hands
its log-probs here (algo.distributed does the cross-rank reduction)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .batch import TrainBatch
from .packing import MicroBatch, to_device


class LossInputs(NamedTuple):
    """A micro-batch's per response token loss inputs, fp32 / bool on the device ([R] each)."""

    behav: torch.Tensor
    adv: torch.Tensor
    weights: Optional[torch.Tensor]  # the rollout correction's, None without one
    policy: Optional[torch.Tensor]  # TrainBatch.loss_mask (True: a policy token), None without one
    mask: torch.Tensor  # the tokens the loss counts: policy tokens of weight > 0


def behav_and_advantages(batch: TrainBatch, mb: MicroBatch, dev) -> LossInputs:
    """The behaviour log-probs, per-token advantages, loss weights and loss mask of `mb`'s response tokens on
    `dev`: stacked on the host, one non-blocking copy. Every consumer that counts response tokens (loss,
    M2PO mask, entropy, metrics) takes `mask`, so environment tokens never count."""
    rows = [torch.cat([batch.behav_log_probs[i].float() for i in mb.seq_index]),
            torch.cat([batch.token_advantages(i) for i in mb.seq_index])]
    if batch.loss_weights is not None:
        rows.append(torch.cat([batch.loss_weights[i].float() for i in mb.seq_index]))
    if batch.loss_mask is not None:  # 0/1 as a float row: exact, and still one copy
        rows.append(torch.cat([batch.loss_mask[i].float() for i in mb.seq_index]))
    out = to_device(torch.stack(rows), dev)
    behav, adv = out[0], out[1]
    weights = out[2] if batch.loss_weights is not None else None
    policy = out[-1] > 0 if batch.loss_mask is not None else None
    if weights is None:
        mask = torch.ones_like(behav, dtype=torch.bool) if policy is None else policy
    else:
        mask = weights > 0 if policy is None else policy & (weights > 0)
    return LossInputs(behav, adv, weights, policy, mask)


def m2po_keep_masks(mb_batch: TrainBatch, mbs: list[MicroBatch], current: dict, *, tau: float, rule: str,
                    dp_group, tokens: str = "trust_region") -> tuple[dict, dict]:
    """From `current` ({id(micro-batch): this rank's log-probs at the current weights}), the M2PO mask over
    the mini-batch across DP ranks. Returns ({id(micro-batch): keep[R_mb]}, the mask's metrics)."""
    from m2po_megatron.algo import distributed as algo_dist

    log_ratios, advs, masks = [], [], []
    for mb in mbs:
        x = behav_and_advantages(mb_batch, mb, current[id(mb)].device)
        log_ratios.append(current[id(mb)] - x.behav)
        advs.append(x.adv)
        masks.append(x.mask)
    res = algo_dist.global_m2po_keep_masks(log_ratios, advs, masks, tau=tau, rule=rule, scope="minibatch",
                                           group=dp_group, tokens=tokens)
    stats = {"m2po_global/num_trust_region": res.num_trust_region, "m2po_global/num_dropped": res.num_dropped,
             "m2po_global/m2_before": res.m2_before, "m2po_global/m2_after": res.m2_after}
    return {id(mb): k for mb, k in zip(mbs, res.keep_masks)}, stats


@torch.no_grad()  # megatron's forward_only does not disable autograd; without this it keeps the graph
def global_keep_masks(actor, mb_batch: TrainBatch, mbs: list[MicroBatch]) -> tuple[dict, dict]:
    """The actor's no-grad forward at its current weights over this rank's micro-batches (routed as the update
    will route them), then the M2PO mask over the mini-batch on all DP ranks: (masks, stats)."""
    cur: dict[int, torch.Tensor] = {}

    def loss_fn(mb, model_out):
        lp, _ = actor._token_logps(mb, model_out, with_entropy=False)
        cur[id(mb)] = lp.detach().float()
        return lp.new_zeros(()), {}

    actor._eval_mode()
    actor._run(mbs, loss_fn, forward_only=True, targets=actor._targets(mb_batch, True))
    if not actor.is_last_stage:
        return {}, {}
    return m2po_keep_masks(mb_batch, mbs, cur, tau=actor.m2po_tau, rule=actor.m2po_rule, dp_group=actor.dp_group,
                           tokens=actor.loss_kwargs.get("m2_tokens", "trust_region"))
