"""The inputs of a micro-batch's loss, and M2PO's batch-level trust-region mask over a whole mini-batch.

`m2po_scope: global` decides which tokens to keep from the second moment of the log-ratios of every token of
the mini-batch on every DP rank, so the actor makes a no-grad forward at the current weights first and hands
its log-probs here (algo.distributed does the cross-rank reduction)."""
from __future__ import annotations

import torch

from .batch import TrainBatch
from .packing import MicroBatch, to_device


def behav_and_advantages(batch: TrainBatch, mb: MicroBatch, dev):
    """The behaviour log-probs, per-token advantages and loss weights (None without them) of `mb`'s response
    tokens, fp32 on `dev`: stacked on the host, one non-blocking copy."""
    rows = [torch.cat([batch.behav_log_probs[i].float() for i in mb.seq_index]),
            torch.cat([batch.token_advantages(i) for i in mb.seq_index])]
    if batch.loss_weights is not None:
        rows.append(torch.cat([batch.loss_weights[i].float() for i in mb.seq_index]))
    out = tuple(to_device(torch.stack(rows), dev))
    return out if len(out) == 3 else (*out, None)


def m2po_keep_masks(mb_batch: TrainBatch, mbs: list[MicroBatch], current: dict, *, tau: float, rule: str,
                    dp_group, tokens: str = "trust_region") -> tuple[dict, dict]:
    """From `current` ({id(micro-batch): this rank's log-probs at the current weights}), the M2PO mask over
    the mini-batch across DP ranks. Returns ({id(micro-batch): keep[R_mb]}, the mask's metrics)."""
    from m2po_megatron.algo import distributed as algo_dist

    log_ratios, advs, masks = [], [], []
    for mb in mbs:
        behav, adv, weights = behav_and_advantages(mb_batch, mb, current[id(mb)].device)
        log_ratios.append(current[id(mb)] - behav)
        advs.append(adv)
        masks.append(torch.ones_like(log_ratios[-1], dtype=torch.bool) if weights is None else weights > 0)
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
