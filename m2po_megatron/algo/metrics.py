"""Exact combination of policy_loss metric dicts over micro-batches (and, in distributed.py, over ranks).

Each mean-type metric carries its weight in a count key, so combined means are exact:
  - summed:              loss and kl_loss (correct when every call used the global denominators num_tokens/num_seqs;
                         otherwise pass loss="mean"), m2po/num_trust_region and the count/* keys;
  - weighted means:      m2po/m2_before by m2po/num_trust_region, m2po/m2_after by count/kept_trust_region,
                         every other fraction / mean / KL estimate by count/tokens;
  - extremes:            ratio/min, ratio/kept_min (min), ratio/max, ratio/kept_max (max);
  - any other key:       plain mean over the dicts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SUM_KEYS = ("loss", "kl_loss", "m2po/num_trust_region", "count/tokens", "count/seqs", "count/kept_trust_region")
MEAN_WEIGHT = {
    "m2po/m2_before": "m2po/num_trust_region",
    "m2po/m2_after": "count/kept_trust_region",
    "m2po/masked_frac": "count/tokens",
    "clip_frac": "count/tokens",
    "dual_clip_frac": "count/tokens",
    "opsm/masked_frac": "count/tokens",
    "ratio/mean": "count/tokens",
    "kl/k1": "count/tokens",
    "kl/k3": "count/tokens",
    "kl_ref/k1": "count/tokens",
    "kl_ref/k3": "count/tokens",
}
MIN_KEYS = ("ratio/min", "ratio/kept_min")
MAX_KEYS = ("ratio/max", "ratio/kept_max")


def to_partials(metrics: dict[str, float], loss: str = "sum") -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(sums, mins, maxes): additive partial sums (means times weights; 1 per dict for plain means, with
    the count under '_n'), and the extremes."""
    sums, mins, maxes = {"_n": 1.0}, {}, {}
    for k, v in metrics.items():
        if k in MIN_KEYS:
            mins[k] = v
        elif k in MAX_KEYS:
            maxes[k] = v
        elif k in MEAN_WEIGHT:
            w = MEAN_WEIGHT[k]
            if w not in metrics:
                raise KeyError(f"metric {k!r} needs its weight {w!r} in the same dict to be combined exactly")
            sums[k] = v * metrics[w]
        elif k in SUM_KEYS and not (k == "loss" and loss == "mean"):
            sums[k] = v
        else:
            sums[k] = v  # plain mean: divided by _n in from_partials
    return sums, mins, maxes


def from_partials(sums: dict[str, float], mins: dict[str, float], maxes: dict[str, float], loss: str = "sum") -> dict[str, float]:
    out: dict[str, float] = {}
    n = sums.get("_n", 1.0)
    for k, s in sums.items():
        if k == "_n":
            continue
        if k in MEAN_WEIGHT:
            w = sums.get(MEAN_WEIGHT[k], 0.0)
            out[k] = s / w if w > 0 else 0.0
        elif k in SUM_KEYS and not (k == "loss" and loss == "mean"):
            out[k] = s
        else:
            out[k] = s / n
    out.update(mins)
    out.update(maxes)
    return out


def sum_partials(dicts: Sequence[dict[str, float]], loss: str = "sum"
                 ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """The partials (see to_partials) of several metric dicts added up: sums added, extremes kept."""
    sums: dict[str, float] = {}
    mins: dict[str, float] = {}
    maxes: dict[str, float] = {}
    for d in dicts:
        s, lo, hi = to_partials(d, loss)
        for k, v in s.items():
            sums[k] = sums.get(k, 0.0) + v
        for k, v in lo.items():
            mins[k] = min(mins.get(k, math.inf), v)
        for k, v in hi.items():
            maxes[k] = max(maxes.get(k, -math.inf), v)
    return sums, mins, maxes


def reduce_metrics(dicts: Sequence[dict[str, float]], loss: str = "sum") -> dict[str, float]:
    """Combine the metric dicts of several policy_loss calls (e.g. the micro-batches of one mini-batch)."""
    if loss not in ("sum", "mean"):
        raise ValueError(f"loss must be 'sum' (calls used global denominators) or 'mean', got {loss!r}")
    if not dicts:
        return {}
    return from_partials(*sum_partials(dicts, loss), loss)
