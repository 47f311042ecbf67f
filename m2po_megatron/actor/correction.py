"""The three-policy step's inputs (algo.rollout_correction), from the trainer's proximal log-probs: no model or
distributed code here, so it is testable alone."""
from __future__ import annotations

import torch

from m2po_megatron.algo import rollout_correction as rc

from .batch import TrainBatch


def three_policy_batch(batch: TrainBatch, proximal: list[torch.Tensor], spec: rc.CorrectionSpec
                       ) -> tuple[TrainBatch, dict]:
    """The batch the losses see, and the correction's metrics: behav_log_probs become the proximal
    log-probs, loss_weights the correction's weights of proximal/behaviour (0 on the tokens a masking mode
    drops, which then also leave the M2PO mask's trust region and the loss denominators, loss_counts).
    `proximal`: one 1-D tensor per sequence, its response length. The batch's loss mask carries over; the
    correction sees only its policy tokens."""
    rl = batch.response_lens
    p = torch.cat([x.float() for x in proximal])
    b = torch.cat([x.float() for x in batch.behav_log_probs])
    seq_ids = torch.repeat_interleave(torch.arange(len(batch)), torch.tensor(rl))
    # environment tokens (loss mask 0) are off the correction: no weight, rejection, sequence sum or metric
    # of theirs (their weight is 1; the loss mask keeps them out of the loss)
    valid = (torch.ones_like(p, dtype=torch.bool) if batch.loss_mask is None
             else torch.cat([m.bool() for m in batch.loss_mask]))
    corr = rc.rollout_correction(p, b, valid, spec, seq_ids=seq_ids, num_seq_ids=len(batch))
    metrics = rc.read_stats([corr.stats])[0]
    out = TrainBatch(batch.input_ids, batch.prompt_lens, behav_log_probs=list(p.split(rl)),
                     advantages=batch.advantages, loss_weights=list(corr.weights.float().split(rl)),
                     routed_experts=batch.routed_experts, loss_mask=batch.loss_mask,
                     ref_log_probs=batch.ref_log_probs)
    return out, metrics
