"""The actor's step metrics: one mini-batch's micro-batches combined over data-parallel ranks, then the
updates of a step combined. The exact combination is algo's (algo.metrics partials, algo.distributed)."""
from __future__ import annotations

import time
from typing import Any, Optional

import torch

from m2po_megatron.algo.distributed import all_reduce_partials
from m2po_megatron.algo.losses import read_loss_stats
from m2po_megatron.algo.metrics import MAX_KEYS, MIN_KEYS, from_partials, sum_partials
from m2po_megatron.algo.rollout_correction import read_stats

# Step metrics summed over a step's updates (the rest are means over updates, except the keys below).
_SUMMED = ("num_tokens", "num_seqs", "num_microbatches", "m2po_global/num_dropped", "m2po_global/num_trust_region",
           "count/tokens", "count/seqs", "ratio_parts/count_tokens", "skipped_empty")


class StepTimes(dict):
    """time/actor/* of a train step: seconds per phase summed over its updates, and the spans behind them
    (name, perf_counter start, end) for the run timeline."""

    def __init__(self, keys):
        super().__init__(dict.fromkeys(keys, 0.0))
        self.spans: list[tuple[str, float, float]] = []

    def add(self, key: str, t0: float, t1: Optional[float] = None) -> None:
        t1 = time.perf_counter() if t1 is None else t1
        self[key] += t1 - t0
        self.spans.append((key, t0, t1))


def read_step_values(stats: list, ent_sums: list[torch.Tensor]) -> tuple[list[dict], float]:
    """The micro-batches' policy_loss metrics (from algo's LossStats) and the entropy sum of a mini-batch, with
    one device read: the same floats as per-micro-batch reads gave. Raises ValueError naming an input that
    held NaN or inf."""
    if not stats:
        return [], 0.0
    rows = torch.cat([torch.stack([s.values for s in stats]),
                      torch.stack(ent_sums).to(torch.float64).unsqueeze(1)], 1).tolist()
    metrics = read_loss_stats(stats, rows)
    entropy_sum = 0.0
    for row in rows:  # in micro-batch order, as the per-micro-batch float() sums were
        entropy_sum += row[-1]
    return metrics, entropy_sum


def reduce_minibatch(mb_metrics: list[dict], entropy_sum: float, mask_stats: dict, *, dp_group,
                     parts: Optional[list] = None, fillers: int = 0) -> dict:
    """The policy_loss metrics of this rank's micro-batches combined with every data-parallel rank's (exact
    weighted means, sums, min/max), plus the token-mean entropy, the micro-batch count and the batch-level
    mask's stats. `parts`: the micro-batches' algo.rollout_correction.ratio_parts (three-policy steps), summed
    on the device, read once and added over the ranks in the same all_reduce. Called on the last pipeline
    stage; every rank of dp_group must call it, all with parts or all without. `fillers`: this rank's
    micro-batches that only hold a filler sequence (dp_share), left out of the micro-batch count."""
    sums, mins, maxes = sum_partials(mb_metrics)
    sums["_entropy_sum"] = entropy_sum
    sums["_mb"] = float(len(mb_metrics) - fillers)
    part_keys = []
    if parts:
        row = torch.stack([p.values for p in parts]).sum(0).tolist()
        part_keys = [f"_parts/{i:03d}" for i in range(len(row))]
        sums.update(zip(part_keys, row))
    sums, mins, maxes = all_reduce_partials(sums, mins, maxes, group=dp_group)
    ent, n_mb = sums.pop("_entropy_sum"), sums.pop("_mb")
    part_row = [sums.pop(k) for k in part_keys]
    result = from_partials(sums, mins, maxes)
    if parts:
        result.update(read_stats([parts[0]], rows=[part_row])[0])  # raises on NaN/inf, on every rank alike
    result["entropy"] = ent / max(result.get("count/tokens", 0.0), 1.0)
    result["num_microbatches"] = int(n_mb)
    result.update(mask_stats)
    return result


def combine_updates(per_update: list[dict], updates_applied: int) -> dict:
    """Metrics of a step: means over its updates, except counts (summed) and extremes; lr is the last one."""
    out: dict[str, Any] = {}
    keys = list(dict.fromkeys(k for u in per_update for k in u))  # a skipped mini-batch has fewer keys
    for k in keys:
        vals = [u[k] for u in per_update if k in u]
        if k in _SUMMED:
            out[k] = sum(vals)
        elif k in MAX_KEYS:
            out[k] = max(vals)
        elif k in MIN_KEYS:
            out[k] = min(vals)
        elif k == "update_successful":
            continue
        elif k == "lr":
            out[k] = vals[-1]
        else:
            out[k] = sum(vals) / len(vals)
    out["num_updates"] = sum(1 for u in per_update if u["update_successful"])
    out["updates_applied_total"] = updates_applied
    out["per_update"] = per_update
    return out
