"""Each data-parallel rank's share of an optimizer mini-batch, a rank with no sequence included.

Dynamic sampling (`train.filter_groups`) can leave a mini-batch with fewer sequences than there are DP ranks.
A rank without a sequence still has to join every collective of the update: the M2PO mask's all_gather,
DDP's gradient reduce-scatter, the optimizer's own, and the metrics' all-reduce. It does so with one filler
sequence of two tokens whose loss weight is 0: it adds nothing to any loss, gradient, count or metric, and
every rank's loss keeps the mini-batch's global denominators, so the update equals the one DP = 1 makes. A
mini-batch with no sequence at all is skipped by every rank alike (no update; see the actor's train_step).

With expert parallelism the expert-parallel group spans data-parallel ranks, and every MoE layer's token
dispatch is a collective of that group in every forward and backward: all its ranks must run as many
micro-batches. `even_microbatches` tops a rank up with micro-batches that hold only the filler sequence, to
the count of the busiest rank (each rank plans every rank's share: the same answer, no communication)."""
from __future__ import annotations

from typing import Optional

import torch

from .batch import TrainBatch
from .packing import pack_by_token_budget, shard_for_dp


def _with_filler(batch: TrainBatch) -> TrainBatch:
    """`batch` and, at index len(batch), one prompt token and one response token (id 0) of loss weight 0 (and
    loss mask 0 when the batch has a loss mask)."""
    rl = batch.response_lens
    adv = batch.advantages
    if isinstance(adv, torch.Tensor):
        adv = torch.cat([adv.float(), adv.new_zeros(1, dtype=torch.float32)])
    elif adv is not None:
        adv = list(adv) + [torch.zeros(1)]
    weights = batch.loss_weights or [torch.ones(r) for r in rl]
    return TrainBatch(
        input_ids=list(batch.input_ids) + [torch.zeros(2, dtype=torch.long)],
        prompt_lens=list(batch.prompt_lens) + [1],
        behav_log_probs=None if batch.behav_log_probs is None else list(batch.behav_log_probs) + [torch.zeros(1)],
        advantages=adv,
        loss_weights=list(weights) + [torch.zeros(1)],
        routed_experts=None if batch.routed_experts is None else list(batch.routed_experts) + [None],
        # not a policy token either: out of every mask, not only the weighted ones
        loss_mask=None if batch.loss_mask is None else list(batch.loss_mask) + [torch.zeros(1, dtype=torch.bool)],
        ref_log_probs=None if batch.ref_log_probs is None else list(batch.ref_log_probs) + [torch.zeros(1)],
    )


def rank_share(batch: TrainBatch, dp_size: int, dp_rank: int, engine: Optional[TrainBatch] = None
               ) -> tuple[TrainBatch, Optional[TrainBatch], list[int], bool]:
    """(batch, engine batch, this rank's sequence indices, whether that is a filler). The batches come back
    as given, or with a filler sequence appended when this rank's share is empty (`engine`: the same
    sequences with the engine's behaviour log-probs, three-policy steps)."""
    shard = shard_for_dp(batch.lengths, dp_size)[dp_rank]
    if shard:
        return batch, engine, shard, False
    return _with_filler(batch), None if engine is None else _with_filler(engine), [len(batch)], True


def skipped_update(lr: float) -> dict:
    """The metrics of a mini-batch with no sequence: no update, on every rank alike."""
    return {"update_successful": False, "skipped_empty": 1, "lr": lr, "num_seqs": 0, "num_tokens": 0}


def even_microbatches(batch: TrainBatch, engine: Optional[TrainBatch], mbs: list, *, dp_size: int, max_tokens: int,
                      plan) -> tuple[TrainBatch, Optional[TrainBatch], list, int]:
    """(batch, engine, micro-batches, fillers added): `mbs` (planned by `plan(batch, indices)` from this rank's
    share of `batch`) topped up with filler-only micro-batches to the most any rank of `dp_size` plans. A
    batch that already ends with a filler (rank_share) reuses it."""
    shards = shard_for_dp(batch.lengths, dp_size)
    target = max((len(pack_by_token_budget([batch.lengths[i] for i in sh], max_tokens)) if sh else 1)
                 for sh in shards)
    extra = target - len(mbs)
    if extra <= 0:
        return batch, engine, mbs, 0
    if not (len(batch) and any(len(batch) - 1 in m.seq_index for m in mbs) and _is_filler(batch)):
        batch = _with_filler(batch)
        engine = None if engine is None else _with_filler(engine)
    fill = [plan(batch, [len(batch) - 1])[0] for _ in range(extra)]  # distinct objects (keyed by id)
    if len({m.seq_len for m in mbs}) == 1:  # one shape, as pipeline stages need (the actor's _plan)
        fill = [m.padded_to(mbs[0].seq_len) for m in fill]
    return batch, engine, mbs + fill, extra


def _is_filler(batch: TrainBatch) -> bool:
    last = batch.input_ids[-1]
    return (last.numel() == 2 and not bool(last.any()) and batch.loss_weights is not None
            and not bool(batch.loss_weights[-1].any()))
