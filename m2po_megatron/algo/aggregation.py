"""Dr.GRPO's aggregation, loss_agg_mode "seq-mean-token-sum-norm" (verl's name; arXiv 2503.20783).

    loss = sum_i sum_t loss_it / (num_seqs * loss_scale_factor)

Each sequence's token sum is divided by one constant instead of its own length (Dr.GRPO's MAX_TOKENS; verl's
loss_scale_factor, AReaL's loss_aggregation="constant" with its divisor), then the sequences are averaged over
the whole optimizer mini-batch (num_seqs is the global count, as for the other seq-mean modes), so the loss and
its gradient do not depend on how the mini-batch is split into micro-batches and data-parallel ranks. verl's
agg_loss returns the sum over one micro-batch's sequences without that mean (docs/algo.md: ours times the
micro-batch's sequence count is verl's value).
"""

from __future__ import annotations

import math

NORM_MODE = "seq-mean-token-sum-norm"


def norm_scale_factor(given, agg: str) -> float | None:
    """The constant of seq-mean-token-sum-norm (None for any other mode). Required: verl's default, the
    micro-batch's padded length, is neither constant nor defined for packed sequences (the recipe passes
    algo.loss_scale_factor, else rollout.max_new_tokens)."""
    if agg != NORM_MODE:
        if given is not None:
            raise ValueError(f"loss_scale_factor applies to loss_agg_mode={NORM_MODE!r} only, not {agg!r}")
        return None
    if given is None:
        raise ValueError(f"loss_agg_mode={NORM_MODE!r} needs loss_scale_factor, the constant each sequence's "
                         f"token sum is divided by (Dr.GRPO's maximum response length)")
    value = float(given)
    if isinstance(given, bool) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"loss_scale_factor must be a finite constant > 0 (e.g. the maximum response length), "
                         f"got {given!r}")
    return value
