"""Pure-torch policy-loss library: GRPO advantages, the M2PO mask, policy losses and their metrics.

Only `m2po_megatron.algo.distributed` touches torch.distributed (the batch-level mask over a process
group); everything else is single-process tensor math. See docs/algo.md.
"""

from m2po_megatron.algo._layout import seq_ids_from_cu_seqlens
from m2po_megatron.algo.advantages import grpo_advantages
from m2po_megatron.algo.distributed import (
    GlobalM2POMask,
    all_reduce_metrics,
    all_reduce_partials,
    global_m2po_keep_masks,
    global_token_counts,
)
from m2po_megatron.algo.losses import AGG_MODES, LOSSES, LossStats, policy_loss, policy_loss_on_device, read_loss_stats
from m2po_megatron.algo.mask import RULES, keep_trust_region, keep_trust_region_values, m2po_keep_mask, trust_region
from m2po_megatron.algo.metrics import from_partials, reduce_metrics, sum_partials, to_partials

__all__ = [
    "AGG_MODES",
    "LOSSES",
    "RULES",
    "GlobalM2POMask",
    "LossStats",
    "all_reduce_metrics",
    "all_reduce_partials",
    "from_partials",
    "global_m2po_keep_masks",
    "global_token_counts",
    "grpo_advantages",
    "keep_trust_region",
    "keep_trust_region_values",
    "m2po_keep_mask",
    "policy_loss",
    "policy_loss_on_device",
    "read_loss_stats",
    "reduce_metrics",
    "seq_ids_from_cu_seqlens",
    "sum_partials",
    "to_partials",
    "trust_region",
]
