"""Rollout correction for a three-policy objective: the weight proximal/behaviour and its metrics (pure math).

Per sampled token, three log-probs:
  behaviour b: the rollout engine's (it generated the token; in bounded mode at an older weight version);
  proximal  p: the trainer's at the weights the step starts from (one no-grad pass);
  theta     t: the current weights (with grad).
log(t/b) = log(t/p) + log(p/b). The first part is the update's drift within the step: the loss (GRPO's clip,
GSPO's, M2PO's second-moment mask) acts on it. The second, d = p - b, is staleness (b ran older weights)
times engine mismatch (kernels, bf16, FP8, MoE routing), which one trainer pass cannot tell apart (that would
need the trainer at b's weights); for tokens sampled at the step's own weights d is the engine mismatch alone.

rollout_correction turns d into a detached per-token weight and a keep mask that the loss multiplies in.
The level log-weight is d (token), its sum over the sequence (sequence: log of the product of token ratios) or
its mean (geometric), clamped to +-SAFETY_BOUND before exp, as verl and slime do. C = threshold,
[lo, hi] = [threshold_lower (default 1/C), C]; bounds are applied in log space to the clamped log-weight.

Modes (w = exp(level log-weight); verl = volcengine/verl `algorithm.rollout_correction`, slime = THUDM/slime):
  bypass:    weight 1, keep = valid; the loss acts on t/b as today.
             verl bypass_mode=true with rollout_is=rollout_rs=null; slime --use-rollout-logprobs.
  tis:       weight min(w, C), keep = valid (truncated IS), level token or sequence.
             verl rollout_is=token|sequence + rollout_is_threshold=C; slime --use-tis --tis-clip C
             (vanilla_tis_function), or mis.py tis_mode=truncate, tis_level=token|sequence, tis_upper_bound=C.
  mis:       weight w, keep = lo <= w <= hi (masked IS), level token or sequence.
             verl rollout_rs=token_k1|seq_sum_k1 (mask) + rollout_is at the same level (weight);
             slime mis.py tis_mode=mask, tis_level=token|sequence, tis_lower_bound, tis_upper_bound.
  icepop:    mis at token level with the band given explicitly ([lo, hi] = [threshold_lower, threshold]).
             slime icepop_function (--tis-clip-low, --tis-clip); verl token_k1 with "lower_upper".
  geometric: w = exp(mean over the sequence of d); action mask: weight w, keep = lo <= w <= hi;
             action truncate: weight min(w, C), keep = valid.
             verl rollout_rs=seq_mean_k1 (mask; "geometric" in verl before 97eac90);
             slime mis.py tis_level=geometric, tis_mode=mask|truncate.

The name icepop is kept because slime and NeMo-RL expose it. verl's "lower_upper" k1 bounds are on
exp(-d) = b/p, so verl's "x_y" is this module's [1/y, 1/x] (the same band when it is symmetric, lo = 1/hi).
Weights are 1 off the valid tokens and 0 on valid tokens the mode drops (so weights * keep == weights).

Host syncs: none in rollout_correction or ratio_parts (masks by `where`, quantiles by one sort and a gather on
the device); each returns one float64 device vector, read with read_stats (one read for any number of them),
which also raises on NaN/inf inputs, as losses.py does. Tokens with a non-finite input are dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from m2po_megatron.algo._layout import (
    as_bool_mask,
    check_same_shape,
    compute_dtype,
    nonfinite_counts,
    raise_nonfinite,
    valid_tokens,
)

Tensor = torch.Tensor

MODES = ("bypass", "tis", "mis", "icepop", "geometric", "clip")
LEVELS = ("token", "sequence")
GEOMETRIC_ACTIONS = ("mask", "truncate", "clip")
# verl's rollout_rs criteria beyond the k1 bands (those are mis and geometric): an upper bound on k2 = d^2/2
# or k3 = exp(d) - 1 - d, per token, or per sequence as their sum, mean or max.
REJECTIONS = ("token_k2", "token_k3", "seq_sum_k2", "seq_sum_k3", "seq_mean_k2", "seq_mean_k3", "seq_max_k2",
              "seq_max_k3")
SAFETY_BOUND = 20.0  # verl's and slime's bound on a log-weight before exp (exp(20) ~ 4.9e8)
QUANTILES = (0.01, 0.5, 0.99)

_CORR = ("n_tokens", "n_seqs", "k1_sum", "k3_sum", "ratio_min", "ratio_p1", "ratio_p50", "ratio_p99",
         "ratio_max", "n_truncated", "n_masked", "n_seqs_masked", "weight_sum", "n_kept", "ess_w_sum",
         "ess_w_sq_sum", "rho_sq_sum", "seq_rho_sq_sum", "norm_factor", "n_vetoed_seqs", "n_rejected")
_PARTS = ("n_tokens",) + tuple(f"{p}_{s}" for p in ("drift", "mismatch", "total") for s in ("sum", "sq_sum")) + (
    "cross_sum",)


@dataclass(frozen=True)
class CorrectionSpec:
    """Which correction, with verl's / slime's names in the module docstring.

    mode: one of MODES. level: "token" or "sequence" for tis and mis (default token); icepop is token level
    and geometric sequence level (None picks that). threshold: C >= 1 (verl rollout_is_threshold /
    rollout_rs_threshold, slime --tis-clip / tis_upper_bound). threshold_lower: the band's lower end,
    0 <= lo <= 1 and lo < C (verl rollout_rs_threshold_lower or the "lower_upper" form, slime --tis-clip-low /
    tis_lower_bound); default 1/C; tis ignores it (truncation from above only).
    geometric_action: "mask" or "truncate"."""

    mode: str = "bypass"
    level: str | None = None
    threshold: float = 2.0
    threshold_lower: float | None = None
    geometric_action: str = "mask"
    batch_normalize: bool = False  # verl rollout_is_batch_normalize, slime --tis-batch-normalize
    veto_threshold: float | None = None  # slime --rs-veto-threshold: drop a sequence with a token p/b below it
    rejection: str | None = None  # verl rollout_rs k2/k3 criteria (REJECTIONS), on top of the mode
    rejection_threshold: float | None = None  # verl rollout_rs_threshold: the criterion's upper bound

    def __post_init__(self):
        f = "rollout_correction"
        if self.mode not in MODES:
            raise ValueError(f"{f}.mode must be one of {MODES}, got {self.mode!r}")
        if self.level is not None and self.level not in LEVELS:
            raise ValueError(f"{f}.level must be one of {LEVELS} (or unset), got {self.level!r}")
        if self.mode == "icepop" and self.level not in (None, "token"):
            raise ValueError(f"{f}.level={self.level!r}: icepop is token level; for a sequence band use mode=mis")
        if self.mode == "geometric" and self.level not in (None, "sequence"):
            raise ValueError(f"{f}.level={self.level!r}: geometric is a sequence-level mean; leave level unset")
        if self.geometric_action not in GEOMETRIC_ACTIONS:
            raise ValueError(f"{f}.geometric_action must be one of {GEOMETRIC_ACTIONS}, got {self.geometric_action!r}")
        # A band without 1, or a cap below 1, would correct on-policy tokens (p = b): refused.
        c = self.threshold
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 1:
            raise ValueError(f"{f}.threshold must be a finite number >= 1 (verl and slime default to 2.0), got {c!r}")
        lo = self.threshold_lower
        if lo is not None and (isinstance(lo, bool) or not isinstance(lo, (int, float)) or not 0 <= lo <= 1
                               or lo >= c):
            raise ValueError(f"{f}.threshold_lower must be a number with 0 <= threshold_lower <= 1 and "
                             f"threshold_lower < threshold={c}, got {lo!r}")
        if lo is not None and not (self.masks or self.clips):  # a bound the mode never applies
            raise ValueError(f"{f}.threshold_lower={lo!r} has no effect with mode={self.mode!r}"
                             + (f", geometric_action={self.geometric_action!r}" if self.mode == "geometric" else "")
                             + ": only the masking and clipping modes (mis, icepop, clip, geometric with mask or clip) "
                             "have a lower bound; remove threshold_lower or pick one of those modes")
        if self.mode == "bypass" and self.level is not None:
            raise ValueError(f"{f}.level={self.level!r} has no effect with mode='bypass' (no correction); remove "
                             f"level or pick mode tis or mis")
        if self.mode == "bypass" and (self.batch_normalize or self.veto_threshold is not None or self.rejection):
            raise ValueError(f"{f}.mode='bypass' has no weights to normalise and no proximal log-probs to reject "
                             f"on: batch_normalize, veto_threshold and rejection need a correction mode (e.g. tis)")
        v = self.veto_threshold
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1):
            raise ValueError(f"{f}.veto_threshold must be in (0, 1) (slime's rs_veto_threshold, e.g. 1e-4), got {v!r}")
        if self.rejection is not None and self.rejection not in REJECTIONS:
            raise ValueError(f"{f}.rejection must be one of {REJECTIONS} (verl's rollout_rs; its k1 bands are "
                             f"mode=mis and mode=geometric), got {self.rejection!r}")
        t = self.rejection_threshold
        if (self.rejection is None) != (t is None):
            raise ValueError(f"{f}.rejection and {f}.rejection_threshold go together: set both or neither")
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)
                              or t <= 0):
            raise ValueError(f"{f}.rejection_threshold must be a finite number > 0 (an upper bound on "
                             f"{self.rejection}), got {t!r}")
        if self.masks and lo is None and c == 1:
            raise ValueError(f"{f}.threshold=1: the band [1/threshold, threshold] is a single point; use "
                             f"threshold > 1 or set threshold_lower")

    @property
    def resolved_level(self) -> str:
        if self.mode == "geometric":
            return "geometric"
        return self.level or "token"

    @property
    def masks(self) -> bool:
        """True when the mode drops tokens outside a band (mis, icepop, geometric with action mask)."""
        return self.mode in ("mis", "icepop") or (self.mode == "geometric" and self.geometric_action == "mask")

    @property
    def truncates(self) -> bool:
        return self.mode == "tis" or (self.mode == "geometric" and self.geometric_action == "truncate")

    @property
    def clips(self) -> bool:
        """Two-sided clip of the weight to the band, nothing dropped (slime's tis_mode=clip)."""
        return self.mode == "clip" or (self.mode == "geometric" and self.geometric_action == "clip")

    def band(self) -> tuple[float, float]:
        """[lo, hi] in log space (lo may be -inf)."""
        lo = 1.0 / self.threshold if self.threshold_lower is None else float(self.threshold_lower)
        return (math.log(lo) if lo > 0 else -math.inf), math.log(self.threshold)


@dataclass
class DeviceStats:
    """Metrics still on the device: `values` float64 (the sums of _CORR or _PARTS, then non-finite counts)."""

    values: Tensor
    kind: str  # "correction" or "parts"
    where: str
    names: tuple[str, ...]  # the checked input tensors, in the order of the trailing counts


@dataclass
class Correction:
    weights: Tensor  # caller's layout, detached: the factor on each token's loss (1 off valid, 0 where dropped)
    keep: Tensor  # caller's layout, bool: valid tokens the mode keeps (fold into the loss mask)
    stats: DeviceStats


def rollout_correction(proximal: Tensor | None, behaviour: Tensor, mask: Tensor, spec: CorrectionSpec,
                       *, seq_ids: Tensor | None = None, num_seq_ids: int | None = None,
                       where: str = "rollout_correction") -> Correction:
    """The correction weights, keep mask and metrics for per-token log-probs `proximal` and `behaviour`
    (padded [B, T] + mask [B, T], or flat [N] + mask [N] + seq_ids, as in _layout.py; sequence and geometric
    levels need sequences). proximal may be None in bypass (weights 1, no mismatch metrics).

    Metrics (read_stats), over the valid tokens: rollout_corr/kl_k1 = mean(b - p) and kl_k3 =
    mean(exp(d) - 1 - d), d = p - b, the two estimators of KL(behaviour || proximal) on behaviour's samples
    (verl's `kl` and `k3_kl`); ratio_min/p1/p50/p99/max of the token ratio p/b (linear interpolation, as
    torch.quantile), whatever the level; truncated_frac (tokens whose level weight exceeded C),
    masked_frac (tokens dropped), seq_masked_frac (sequences with a dropped token, over sequences with a
    valid token), weight_mean (over kept tokens), count_tokens, count_kept, count_seqs."""
    if proximal is None and spec.mode != "bypass":
        raise ValueError(f"{where}: mode={spec.mode!r} needs the proximal log-probs (the trainer's pass at the "
                         f"step's starting weights); only mode=bypass runs without them")
    mask = as_bool_mask(mask, "mask")
    check_same_shape("mask", mask, proximal=proximal, behaviour=behaviour)
    vt = valid_tokens(mask, seq_ids, where, num_seq_ids)
    level = spec.resolved_level
    if level != "token" and not vt.known_seqs:
        raise ValueError(f"{where}: level {level!r} needs sequences; pass seq_ids with flat inputs")
    if not vt.known_seqs and (spec.veto_threshold is not None or (spec.rejection or "token").startswith("seq")):
        raise ValueError(f"{where}: veto_threshold and sequence rejection criteria need sequences; pass seq_ids")
    has_p = proximal is not None
    with torch.no_grad():
        b = vt.take(behaviour).detach()
        p = vt.take(proximal).detach() if has_p else b
        dtype = compute_dtype(p, b)
        p, b = p.to(dtype), b.to(dtype)
        bad = nonfinite_counts(vt.valid, p, b)
        if not has_p:  # p is b here: count it once, under its own name
            bad = torch.cat([torch.zeros_like(bad[:1]), bad[1:]])
        valid = vt.valid & torch.isfinite(p) & torch.isfinite(b)
        zero = torch.zeros((), dtype=dtype, device=b.device)
        d = torch.where(valid, p - b, zero)  # log(p/b); exactly 0 off the valid tokens
        if level == "token":
            lw = d
        else:
            s = vt.seq_sum(d)
            if level == "geometric":
                s = s / vt.seq_sum(valid.to(dtype)).clamp(min=1)
            lw = s[vt.seq]
        lw = lw.clamp(-SAFETY_BOUND, SAFETY_BOUND)
        w = torch.exp(lw)
        one = torch.ones_like(w)
        log_c = math.log(spec.threshold)
        truncated = valid & (lw > log_c) if spec.truncates else torch.zeros_like(valid)
        if spec.mode == "bypass":
            keep, weights = valid, one
        elif spec.truncates:
            keep, weights = valid, torch.where(valid, w.clamp(max=spec.threshold), one)
        elif spec.clips:
            lo, hi = spec.band()
            keep, weights = valid, torch.where(valid, torch.exp(lw.clamp(lo, hi)), one)
        else:
            lo, hi = spec.band()
            keep = valid & (lw >= lo) & (lw <= hi)
            weights = torch.where(keep, w, torch.where(valid, zero, one))
        before = keep
        vetoed = torch.zeros_like(valid)
        if spec.veto_threshold is not None:  # slime: a sequence with one token far below the engine's goes whole
            low = valid & (d < math.log(spec.veto_threshold))
            vetoed = valid & (vt.seq_sum(low.to(dtype)) > 0)[vt.seq]
            keep = keep & ~vetoed
        if spec.rejection:
            keep = keep & _passes(vt, valid, d, spec.rejection, spec.rejection_threshold)
        weights = torch.where(keep, weights, torch.where(valid, zero, one))
        factor = torch.ones((), dtype=dtype, device=b.device)
        if spec.batch_normalize:  # verl: mean 1 over the tokens (token level) or the sequences it weighs
            kw = torch.where(keep, weights, zero)
            if level == "token":
                mean = kw.sum() / keep.sum().clamp(min=1)
            else:
                n_k = vt.seq_sum(keep.to(dtype))
                seq_w = vt.seq_sum(kw) / n_k.clamp(min=1)
                mean = (seq_w * (n_k > 0)).sum() / (n_k > 0).sum().clamp(min=1)
            factor = torch.where(mean > 1e-8, mean, torch.ones_like(mean))
            weights = torch.where(keep, weights / factor, weights)
        ess_w = torch.exp(lw.clamp(-log_c, log_c))  # verl's ESS: the level weights clamped to [1/C, C]
        values = _correction_stats(vt, valid, d, truncated, keep, weights, bad, ess_w, factor,
                                   vetoed, before & ~keep & ~vetoed)
    return Correction(weights=weights.reshape(vt.shape), keep=keep.reshape(vt.shape),
                      stats=DeviceStats(values, "correction" if has_p else "correction_nop", where,
                                        ("proximal", "behaviour")))


def _masked_quantiles(x: Tensor, valid: Tensor, n: Tensor, qs) -> Tensor:
    """[min, q..., max] of x over the valid entries, linear interpolation as torch.quantile, on the device
    (invalid entries sort last as +inf; NaN when nothing is valid)."""
    f64 = torch.float64
    if x.numel() == 0:
        return torch.full((len(qs) + 2,), math.nan, dtype=f64, device=x.device)
    xs = torch.sort(torch.where(valid, x, torch.full_like(x, math.inf))).values
    last = (n - 1).clamp(min=0)
    last_f = last.to(f64)
    pos = torch.stack([last_f * q for q in (0.0, *qs, 1.0)])  # no torch.tensor: a host-to-device copy syncs
    lo = pos.floor().long().clamp(max=last)
    hi = (lo + 1).clamp(max=last)
    vlo, vhi = xs.gather(0, lo), xs.gather(0, hi)
    frac = pos - lo.to(f64)
    out = torch.where(frac > 0, vlo + (vhi - vlo) * frac, vlo)  # frac 0: no inf - inf
    return torch.where(n > 0, out, torch.full_like(out, math.nan))


def _passes(vt, valid, d: Tensor, rejection: str, threshold: float) -> Tensor:
    """verl's rollout_rs k2/k3 criteria: True where the token (or its sequence) is within the bound."""
    dc = d.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    stat = 0.5 * dc.square() if rejection.endswith("k2") else torch.expm1(dc) - dc
    stat = torch.where(valid, stat, torch.zeros_like(stat))
    if rejection.startswith("token"):
        return stat <= threshold
    s = vt.seq_sum(stat)
    if rejection.startswith("seq_mean"):
        s = s / vt.seq_sum(valid.to(stat.dtype)).clamp(min=1)
    elif rejection.startswith("seq_max"):
        s = torch.zeros_like(s).scatter_reduce(0, vt.seq, stat, reduce="amax", include_self=False)
    return (s <= threshold)[vt.seq]


def _correction_stats(vt, valid, d, truncated, keep, weights, bad, ess_w, factor, vetoed, rejected) -> Tensor:
    f64 = torch.float64
    d64 = d.to(f64)
    zero = torch.zeros((), dtype=f64, device=d.device)
    n = valid.sum()
    dropped = valid & ~keep
    if vt.known_seqs:
        n_seqs = (vt.seq_sum(valid.to(f64)) > 0).sum().to(f64)
        n_seqs_masked = (vt.seq_sum(dropped.to(f64)) > 0).sum().to(f64)
    else:
        n_seqs = n_seqs_masked = torch.full((), -1.0, dtype=f64, device=d.device)
    q = _masked_quantiles(torch.exp(d64), valid, n, QUANTILES)
    e = torch.where(keep, ess_w.to(f64), zero)
    dc = d64.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if vt.known_seqs:  # verl's chi2_seq: E over sequences of (prod of the token ratios)^2, minus 1
        has = vt.seq_sum(valid.to(f64)) > 0
        seq_rho = torch.where(has, torch.exp(2 * vt.seq_sum(d64).clamp(-SAFETY_BOUND, SAFETY_BOUND)), zero).sum()
        n_vetoed = (vt.seq_sum(vetoed.to(f64)) > 0).sum().to(f64)
    else:
        seq_rho = n_vetoed = torch.full((), -1.0, dtype=f64, device=d.device)
    return torch.cat([torch.stack([
        n.to(f64), n_seqs, (-d64).sum(), torch.where(valid, torch.expm1(d64) - d64, zero).sum(),
    ]), q, torch.stack([
        truncated.sum().to(f64), dropped.sum().to(f64), n_seqs_masked,
        torch.where(keep, weights.to(f64), zero).sum(), keep.sum().to(f64),
        e.sum(), e.square().sum(), torch.where(valid, torch.exp(2 * dc), zero).sum(), seq_rho,
        factor.to(f64), n_vetoed, rejected.sum().to(f64),
    ]), bad.to(f64)])


def split_log_ratio(log_prob: Tensor, proximal: Tensor, behaviour: Tensor) -> tuple[Tensor, Tensor]:
    """(drift, mismatch) = (log(t/p), log(p/b)); drift + mismatch = log(t/b), today's loss log-ratio.
    drift keeps log_prob's grad: it is the loss's log-ratio in three-policy modes."""
    return log_prob - proximal.detach(), (proximal - behaviour).detach()


def ratio_parts(log_prob: Tensor, proximal: Tensor, behaviour: Tensor, mask: Tensor,
                where: str = "ratio_parts") -> DeviceStats:
    """Per-call sums of the two parts of log(t/b) and their squares (read: means, second moments over the
    valid tokens, and the cross term: total_m2 = drift_m2 + mismatch_m2 + 2 * cross)."""
    mask = as_bool_mask(mask, "mask")
    check_same_shape("mask", mask, log_prob=log_prob, proximal=proximal, behaviour=behaviour)
    with torch.no_grad():
        t, p, b = (x.detach().reshape(-1) for x in (log_prob, proximal, behaviour))
        dtype = torch.float64
        bad = nonfinite_counts(mask.reshape(-1), t, p, b)
        valid = mask.reshape(-1) & torch.isfinite(t) & torch.isfinite(p) & torch.isfinite(b)
        zero = torch.zeros((), dtype=dtype, device=t.device)
        drift, mism = (torch.where(valid, x.to(dtype), zero) for x in split_log_ratio(t.to(dtype), p.to(dtype),
                                                                                       b.to(dtype)))
        total = drift + mism
        sums = [valid.sum().to(dtype)]
        for x in (drift, mism, total):
            sums += [x.sum(), x.square().sum()]
        values = torch.cat([torch.stack(sums + [(drift * mism).sum()]), bad.to(dtype)])
    return DeviceStats(values, "parts", where, ("log_prob", "proximal", "behaviour"))


def read_stats(stats: list[DeviceStats], rows: list[list[float]] | None = None) -> list[dict[str, float]]:
    """The metric dicts of several DeviceStats with one device read; raises ValueError naming the first input
    that held NaN or inf on a valid token. `rows`: values already read by the caller (one list each)."""
    if not stats:
        return []
    if rows is None:
        width = max(s.values.numel() for s in stats)
        rows = [r[:s.values.numel()] for s, r in zip(stats, torch.stack(
            [torch.nn.functional.pad(s.values, (0, width - s.values.numel())) for s in stats]).tolist())]
    out = []
    for s, row in zip(stats, rows):
        k = len(_PARTS) if s.kind == "parts" else len(_CORR)
        raise_nonfinite(s.where, s.names, row[k:k + len(s.names)])
        out.append(_parts_metrics(row) if s.kind == "parts" else _correction_metrics(row, s.kind == "correction"))
    return out


def _mean(s, c):
    return s / c if c > 0 else 0.0


def _correction_metrics(row, has_mismatch: bool) -> dict[str, float]:
    v = dict(zip(_CORR, row))
    n = v["n_tokens"]
    out = {
        "rollout_corr/truncated_frac": _mean(v["n_truncated"], n),
        "rollout_corr/masked_frac": _mean(v["n_masked"], n),
        "rollout_corr/weight_mean": _mean(v["weight_sum"], v["n_kept"]),
        "rollout_corr/count_tokens": n,
        "rollout_corr/count_kept": v["n_kept"],
    }
    k = v["n_kept"]
    out["rollout_corr/ess"] = v["ess_w_sum"] ** 2 / (k * v["ess_w_sq_sum"]) if k and v["ess_w_sq_sum"] > 0 else 0.0
    out["rollout_corr/batch_norm_factor"] = v["norm_factor"]
    out["rollout_corr/rejected_frac"] = _mean(v["n_rejected"], n)
    if v["n_seqs"] >= 0:
        out["rollout_corr/seq_masked_frac"] = _mean(v["n_seqs_masked"], v["n_seqs"])
        out["rollout_corr/count_seqs"] = v["n_seqs"]
        out["rollout_corr/vetoed_seq_frac"] = _mean(v["n_vetoed_seqs"], v["n_seqs"])
    if has_mismatch:
        out["rollout_corr/kl_k1"] = _mean(v["k1_sum"], n)
        out["rollout_corr/kl_k3"] = _mean(v["k3_sum"], n)
        out["rollout_corr/chi2_token"] = _mean(v["rho_sq_sum"], n) - 1.0 if n else 0.0
        if v["n_seqs"] > 0:
            out["rollout_corr/chi2_seq"] = v["seq_rho_sq_sum"] / v["n_seqs"] - 1.0
        for key in ("ratio_min", "ratio_p1", "ratio_p50", "ratio_p99", "ratio_max"):
            out[f"rollout_corr/{key}"] = v[key]
    return out


def _parts_metrics(row) -> dict[str, float]:
    v = dict(zip(_PARTS, row))
    n = v["n_tokens"]
    out = {"ratio_parts/count_tokens": n, "ratio_parts/cross": _mean(v["cross_sum"], n)}
    for part in ("drift", "mismatch", "total"):
        out[f"ratio_parts/{part}_mean"] = _mean(v[f"{part}_sum"], n)
        out[f"ratio_parts/{part}_m2"] = _mean(v[f"{part}_sq_sum"], n)
    return out
