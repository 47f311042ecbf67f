"""Policy losses on behaviour-policy samples: m2po, grpo, grpo_notr, gspo, cispo.

Every loss is a surrogate whose gradient with respect to log_prob on an *active* token is -A * r / D
(r = exp(log_prob - behav_log_prob), D the aggregation denominator) and zero on every other token:
  - m2po:      active = kept by the M2PO mask (no epsilon clip); dropped tokens contribute 0 but stay in D.
  - grpo:      PPO clip: inactive where A > 0 and r > 1 + eps_high, or A < 0 and r < 1 - eps_low.
  - grpo_notr: plain r * A (no trust region at all).
  - gspo:      r is replaced by the sequence ratio s = exp(mean_t log-ratio), straight-through per token as
               verl's (value s, gradient through each token's own log-prob and weight); PPO clip on s with
               GSPO's small range (3e-4, 4e-4); sequence mean.
  - cispo:     not a ratio surrogate: -sg(clip(r)) * A * log_prob on every token, gradient -A * clip(r) / D
               (algo/cispo.py).
  - opsm_delta (any loss): off-policy sequence masking; its dropped tokens are inactive and stay in D
               (algo/seq_mask.py).
  - dual_clip=c (any loss but cispo, M2PO included): tokens with A < 0 and r > c are also inactive (loss -A*c),
    which bounds the large-ratio negative tokens that lie outside T (see docs/algo.md).
  - kl_coef with ref_log_prob (any loss): + kl_coef x KL(theta || reference) per token (algo/kl.py's types),
    and entropy_coeff with entropy (any loss): - entropy_coeff x the token's entropy. Both act on every valid
    token, those M2PO, a clip or the sequence mask leave out of the policy term included (as verl's and
    slime's do: those masks are the policy gradient's), and are aggregated with the policy term's mode and
    denominators, so the three sum per token before aggregation.
The active set is decided on detached values first and exp() is only evaluated on active tokens, so a
huge ratio on an inactive token cannot turn the gradient into NaN (0 * inf).

Host syncs: policy_loss_on_device computes the loss and every metric without reading the device (masks by
`where`, no gathering of valid positions; denominators given by the caller) and returns the metrics as one
device vector, LossStats, together with the count of NaN/inf inputs; a trainer keeps those per micro-batch and
reads them all once per optimizer update (read_loss_stats), which also raises on non-finite inputs. Tokens
with a non-finite input are left out of the loss, so its gradient stays finite until that read raises.
policy_loss is the same computation read at once.
"""

from __future__ import annotations

import math

import torch

from dataclasses import dataclass

from m2po_megatron.algo._layout import (
    as_bool_mask,
    check_same_shape,
    compute_dtype,
    nonfinite_counts,
    raise_nonfinite,
    valid_tokens,
)
from m2po_megatron.algo.aggregation import norm_scale_factor
from m2po_megatron.algo.cispo import DEFAULT_EPS as CISPO_EPS, check_eps as check_cispo_eps, cispo_surrogate
from m2po_megatron.algo.kl import check_kl_type, kl_penalty
from m2po_megatron.algo.mask import bounded_tokens, check_tau_rule, keep_trust_region
from m2po_megatron.algo.seq_mask import check_delta, opsm_drop

Tensor = torch.Tensor

LOSSES = ("m2po", "grpo", "grpo_notr", "gspo", "cispo")
# seq-mean-token-sum-norm: Dr.GRPO's constant normalisation, sum_seqs sum_tokens / (num_seqs * loss_scale_factor)
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
DEFAULT_EPS = {"grpo": (0.2, 0.2), "gspo": (3e-4, 4e-4), "cispo": CISPO_EPS}  # (eps_low, eps_high)
DEFAULT_AGG = {"m2po": "token-mean", "grpo": "token-mean", "grpo_notr": "token-mean", "gspo": "seq-mean-token-mean",
               "cispo": "token-mean"}


_CHECKED = ("log_prob", "behav_log_prob", "advantages", "ref_log_prob")
# The device vector of LossStats: these sums and counts, then the non-finite counts of _CHECKED.
_STATS = ("loss", "sum_v_tr", "n_tr", "sum_v_kept", "n_kept", "n_masked", "n_clip", "n_dual", "ratio_sum",
          "ratio_min", "ratio_max", "k1_sum", "k3_sum", "n_tokens", "n_seqs", "kept_min", "kept_max", "n_opsm",
          "kl_loss", "ref_k1_sum", "ref_k3_sum")


@dataclass
class LossStats:
    """policy_loss's metrics still on the device: `values` [len(_STATS) + 4] float64 (see _STATS, then the
    non-finite counts of _CHECKED). Read with read_loss_stats."""

    values: Tensor
    where: str
    has_seqs: bool
    has_opsm: bool = False
    has_ref: bool = False


def read_loss_stats(stats: list[LossStats], rows: list[list[float]] | None = None) -> list[dict[str, float]]:
    """The metric dicts of several LossStats with one device read; raises ValueError naming the first tensor
    that held NaN or inf on a valid token. `rows`: the values already read by the caller (one list per
    LossStats, starting with its values; extra trailing entries are the caller's)."""
    if not stats:
        return []
    if rows is None:
        rows = torch.stack([s.values for s in stats]).tolist()
    for s, row in zip(stats, rows):
        raise_nonfinite(s.where, _CHECKED, row[len(_STATS):len(_STATS) + len(_CHECKED)])
    return [_metrics_from_row(row, s.has_seqs, s.has_opsm, s.has_ref) for s, row in zip(stats, rows)]


def _denominator(given, local: Tensor, what: str, arg: str):
    """The given count (a float), or this call's own count (a device tensor) when None."""
    if given is None:
        return local.to(torch.float64)
    value = float(given.item()) if isinstance(given, Tensor) else float(given)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{arg} must be a finite count >= 0, got {given!r}")
    if value == 0 and int(local) > 0:  # reads the device, only for a zero denominator
        raise ValueError(f"{arg}=0 but this call has {int(local)} {what}; pass the global count over the mini-batch")
    return value


def _divide(total: Tensor, denom) -> Tensor:
    if isinstance(denom, Tensor):
        ok = denom > 0
        return torch.where(ok, total / torch.where(ok, denom, torch.ones_like(denom)).to(total.dtype), total * 0.0)
    return total / denom if denom > 0 else total * 0.0


def _surrogate(lr, A, keep, eps, dual_clip):
    """Per-token loss, plus (clipped, dual_clipped) flags, for token log-ratios `lr` (differentiable)."""
    lr_d = lr.detach()
    r = torch.exp(lr_d)
    zero = torch.zeros_like(r)
    if eps is not None:
        lo, hi = 1.0 - eps[0], 1.0 + eps[1]
        clipped = ((A > 0) & (r > hi)) | ((A < 0) & (r < lo))
        clip_value = -A * r.clamp(lo, hi)
    else:
        clipped = torch.zeros_like(keep)
        clip_value = zero
    if dual_clip is not None:
        dual = (A < 0) & ~clipped & keep & (r > dual_clip)
    else:
        dual = torch.zeros_like(keep)
    active = keep & ~clipped & ~dual & (A != 0)
    const = torch.where(clipped, clip_value, zero)
    if dual_clip is not None:
        const = torch.where(dual, -A * dual_clip, const)
    ratio_active = torch.exp(torch.where(active, lr, torch.zeros_like(lr)))
    tok = torch.where(active, -A * ratio_active, const)
    return tok, clipped, dual


def policy_loss(
    name: str,
    log_prob: Tensor,
    behav_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    **kwargs,
) -> tuple[Tensor, dict[str, float]]:
    """Loss to minimise (a 0-d tensor with grad through log_prob) and float metrics for logging.

    Args:
        name: "m2po", "grpo", "grpo_notr", "gspo" or "cispo".
        log_prob: log pi_theta of the sampled tokens (with grad); padded [B, T] or flat [N].
        behav_log_prob: log pi_behav of the same tokens (the policy that generated them); not differentiated.
        advantages: per-token advantages of the same shape; for padded inputs [B, 1] is broadcast.
        mask: valid tokens (bool or 0/1), same shape as log_prob.
        seq_ids: flat inputs only: integer sequence id per token [N]; needed for gspo and seq-mean modes.
        num_seq_ids: flat inputs whose seq_ids are dense, 0..num_seq_ids-1 (built on the host from known
            lengths): saves the torch.unique that makes arbitrary ids dense (a host sync).
        loss_agg_mode: "token-mean" (sum over valid tokens / num_tokens; the paper's; masked tokens stay in
            the denominator), "seq-mean-token-mean" or "seq-mean-token-sum" (/ num_seqs), or
            "seq-mean-token-sum-norm" (Dr.GRPO: token sums / (num_seqs * loss_scale_factor)). Default:
            token-mean, and seq-mean-token-mean for gspo.
        loss_scale_factor: seq-mean-token-sum-norm only, and required there (verl's name): the constant each
            sequence's token sum is divided by (Dr.GRPO's MAX_TOKENS; the recipe passes rollout.max_new_tokens).
        num_tokens, num_seqs: the denominators. Default: the valid tokens / sequences of this call. Pass the
            counts of the whole optimizer mini-batch over all micro-batches and data-parallel ranks (see
            distributed.global_m2po_keep_masks / global_token_counts) so that the sum of the per-micro-batch,
            per-rank losses is the full-batch loss and its gradient. For seq-mean modes every sequence must
            lie entirely inside one call.
        keep_mask: m2po only: an externally computed keep mask (e.g. the mini-batch-wide mask from
            distributed.global_m2po_keep_masks), same shape. If None the mask is computed over this call's
            tokens (the released code's per-micro-batch scope).
        tau, rule: the M2PO bound and rule when keep_mask is None (see mask.m2po_keep_mask).
        m2_tokens: the tokens whose M2 is bounded and reported: "trust_region" (T, the paper's) or "all"
            (every valid token, AReaL's port); the m2po/* metrics are over that set.
        eps_low, eps_high: PPO clip range for grpo (default 0.2, 0.2) and gspo (default 3e-4, 4e-4); CISPO's
            weight clip [1 - eps_low, 1 + eps_high] for cispo (default 1.0, 0.2: no lower bound).
        dual_clip: c > 1: tokens with A < 0 and ratio > c get a constant loss -A*c (zero gradient). Any loss
            but cispo (whose weight is already capped).
        opsm_delta: off-policy sequence masking (slime's --opsm-delta; None: off): a token with A < 0 whose
            sequence's mean log(pi_behav / pi_theta) exceeds it leaves the loss (stays in the denominator).
            Needs sequences (padded rows, or flat seq_ids).
        weights: detached per-token factors >= 0 on each token's loss, same shape (a rollout correction's
            importance weights, algo.rollout_correction); the denominators are unchanged. None: all 1.
            They weigh the policy term only, not the KL or entropy terms.
        ref_log_prob, kl_coef, kl_type: the reference model's log-probs of the same tokens (detached) and the
            KL term's weight and estimator (algo.kl.KL_TYPES; verl's kl_loss_coef / kl_loss_type). None: no
            KL term. The metrics then add kl_loss (the aggregated KL, before the coefficient), kl_ref/k1 and
            kl_ref/k3 (token means of log(theta / reference) and its k3, whatever the type).
        entropy, entropy_coeff: per-token entropy of theta (with its gradient, actor.fused_logprobs) and the
            bonus's weight (verl's entropy_coeff): the loss adds -entropy_coeff x entropy per token.

    Returns:
        (loss, metrics). Metric keys: loss, m2po/m2_before, m2po/m2_after, m2po/masked_frac,
        m2po/num_trust_region, clip_frac, dual_clip_frac, ratio/mean, ratio/min, ratio/max, ratio/kept_min,
        ratio/kept_max, kl/k1, kl/k3, count/tokens, count/kept_trust_region (and count/seqs when sequences are
        known, opsm/masked_frac with opsm_delta: the fraction of valid tokens it drops). For cispo, clip_frac
        is the fraction of tokens whose weight is clipped (they keep a gradient). ratio/min and ratio/max
        range over every valid token; ratio/kept_* only over the tokens the
        trust region keeps (M2PO's mask, PPO's clip and the dual clip; for grpo_notr every valid token), i.e.
        the ratios that can still reach the gradient. kl/k1 and kl/k3
        estimate KL(pi_behav || pi_theta) from the behaviour samples: k1 = -log r, k3 = r - 1 - log r.
        M2 diagnostics are reported for every loss (for non-m2po losses nothing is masked). Combine the
        dicts of several micro-batches with metrics.reduce_metrics, of several ranks with
        distributed.all_reduce_metrics. Raises ValueError naming the tensor if a valid token holds NaN or inf.
        Reads the device once (the metrics); policy_loss_on_device does not read it at all.
    """
    loss, stats = policy_loss_on_device(name, log_prob, behav_log_prob, advantages, mask, **kwargs)
    return loss, read_loss_stats([stats])[0]


def policy_loss_on_device(
    name: str,
    log_prob: Tensor,
    behav_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    seq_ids: Tensor | None = None,
    num_seq_ids: int | None = None,
    loss_agg_mode: str | None = None,
    num_tokens: int | float | Tensor | None = None,
    num_seqs: int | float | Tensor | None = None,
    keep_mask: Tensor | None = None,
    tau: float = 0.04,
    rule: str = "remove",
    m2_tokens: str = "trust_region",
    eps_low: float | None = None,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    weights: Tensor | None = None,
    opsm_delta: float | None = None,
    loss_scale_factor: float | None = None,
    ref_log_prob: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_type: str = "low_var_kl",
    entropy: Tensor | None = None,
    entropy_coeff: float = 0.0,
) -> tuple[Tensor, LossStats]:
    """policy_loss without reading the device: (loss, LossStats). Arguments as policy_loss. Non-finite inputs
    on valid tokens do not raise here: those tokens are left out of the loss and counted in the stats, and
    read_loss_stats raises."""
    where = f"policy_loss({name!r})"
    if name not in LOSSES:
        raise ValueError(f"name must be one of {LOSSES}, got {name!r}")
    agg = loss_agg_mode or DEFAULT_AGG[name]
    if agg not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {agg!r}")
    if keep_mask is not None and name != "m2po":
        raise ValueError(f"keep_mask applies to the m2po loss only, not {name!r}")
    if dual_clip is not None and not (float(dual_clip) > 1.0):
        raise ValueError(f"dual_clip must be > 1 (e.g. 3.0) or None, got {dual_clip!r}")
    if dual_clip is not None and name == "cispo":
        raise ValueError("dual_clip does not apply to cispo: its importance weight is already capped at 1 + eps_high")
    if opsm_delta is not None:
        opsm_delta = check_delta(opsm_delta)
    if name in DEFAULT_EPS:
        d_lo, d_hi = DEFAULT_EPS[name]
        eps = (d_lo if eps_low is None else float(eps_low), d_hi if eps_high is None else float(eps_high))
        if name == "cispo":
            check_cispo_eps(*eps)
        elif not (0 <= eps[0] < 1 and eps[1] >= 0):
            raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps[0]}, eps_high={eps[1]}")
    else:
        if eps_low is not None or eps_high is not None:
            raise ValueError(f"eps_low/eps_high apply to grpo, gspo and cispo; {name!r} has no epsilon clip")
        eps = None
    if name == "m2po" and keep_mask is None:
        check_tau_rule(tau, rule)
    if ref_log_prob is not None:
        kl_type = check_kl_type(kl_type)
        if not (math.isfinite(float(kl_coef)) and float(kl_coef) >= 0):
            raise ValueError(f"kl_coef must be a finite weight >= 0 (verl's kl_loss_coef, e.g. 0.001), got {kl_coef!r}")
    if not math.isfinite(float(entropy_coeff)):
        raise ValueError(f"entropy_coeff must be finite, got {entropy_coeff!r}")
    if entropy_coeff and entropy is None:
        raise ValueError("entropy_coeff needs the per-token entropy (with its gradient)")

    mask = as_bool_mask(mask, "mask")
    if log_prob.dim() == 2 and advantages.dim() == 2 and advantages.shape[1] == 1:
        advantages = advantages.expand_as(log_prob)
    if advantages.dim() != log_prob.dim():
        raise ValueError(
            f"{where}: advantages has shape {tuple(advantages.shape)}, log_prob {tuple(log_prob.shape)}; "
            f"broadcast per-sequence advantages to tokens (adv[:, None] padded, adv[seq_ids] flat)"
        )
    check_same_shape("log_prob", log_prob, behav_log_prob=behav_log_prob, advantages=advantages, mask=mask,
                     keep_mask=keep_mask, weights=weights, ref_log_prob=ref_log_prob,
                     entropy=entropy if entropy_coeff else None)

    vt = valid_tokens(mask, seq_ids, where, num_seq_ids)
    needs_seqs = name == "gspo" or agg != "token-mean" or opsm_delta is not None
    if needs_seqs and not vt.known_seqs:
        raise ValueError(f"{where}: flat inputs need seq_ids for gspo, seq-mean aggregation (loss_agg_mode={agg!r}) "
                         f"and opsm_delta")
    scale = norm_scale_factor(loss_scale_factor, agg)
    dtype = compute_dtype(log_prob, behav_log_prob)
    lp = vt.take(log_prob).to(dtype)
    blp = vt.take(behav_log_prob).detach().to(dtype)
    A = vt.take(advantages).detach().to(dtype)
    bad = nonfinite_counts(vt.valid, lp.detach(), blp, A)
    # Tokens with a non-finite input leave the loss (read_loss_stats raises on them); every other invalid
    # position is zeroed, so it is off T, inactive, and adds exactly 0 to every sum.
    valid = vt.valid & torch.isfinite(lp.detach()) & torch.isfinite(blp) & torch.isfinite(A)
    zero = torch.zeros((), dtype=dtype, device=lp.device)
    lr = torch.where(valid, lp, zero) - torch.where(valid, blp, zero)
    A = torch.where(valid, A, zero)
    lr_d = lr.detach()
    n = valid.sum()

    tr = bounded_tokens(lr_d, A, valid, m2_tokens)  # T (or every valid token): M2's tokens
    if name == "m2po":
        if keep_mask is not None:
            keep = vt.take(as_bool_mask(keep_mask, "keep_mask"))
        else:
            keep = keep_trust_region(lr_d, tr, tau, rule)
    else:
        keep = torch.ones_like(tr)
    dropped = opsm_drop(lr_d, A, valid, vt, opsm_delta) if opsm_delta is not None else None
    active = keep if dropped is None else keep & ~dropped  # M2PO's mask and the sequence mask, both

    ones = valid.to(dtype)
    if name == "cispo":
        tok, clipped = cispo_surrogate(torch.where(valid, lp, zero), lr, A, valid & active, eps)
        dual = torch.zeros_like(clipped)
    elif name == "gspo":
        seq_len = vt.seq_sum(ones).clamp(min=1)  # empty sequences: 0 / 1, never 0 / 0 in backward
        seq_lr = vt.seq_sum(lr.detach()) / seq_len
        # verl's straight-through token ratio sg[log s] + l_t - sg[l_t]: the value is the sequence's, the
        # gradient reaches each token through its own weight (uniform weights: the same gradient as through
        # the mean; per-token weights are not averaged over the sequence)
        st = seq_lr[vt.seq] + lr - lr.detach()
        tok, clipped, dual = _surrogate(torch.where(valid, st, zero), A, active, eps, dual_clip)
    else:
        tok, clipped, dual = _surrogate(lr, A, active, eps, dual_clip)
    if weights is not None:  # off the valid tokens the factor is 1, so a NaN there cannot reach the sums
        tok = tok * torch.where(valid, vt.take(weights).detach().to(dtype), torch.ones((), dtype=dtype,
                                                                                       device=lp.device))

    seq_count = vt.seq_sum(ones) if vt.known_seqs else None
    n_seqs = (seq_count > 0).sum() if seq_count is not None else None
    if agg == "token-mean":
        denom = _denominator(num_tokens, n, "valid tokens", "num_tokens")
    else:
        denom = _denominator(num_seqs, n_seqs, "sequences", "num_seqs")

    def aggregate(per_token: Tensor) -> Tensor:
        if agg == "token-mean":
            return _divide(per_token.sum(), denom)
        per_seq = vt.seq_sum(per_token)
        if agg == "seq-mean-token-mean":
            per_seq = per_seq / seq_count.clamp(min=1)
        total = per_seq.sum()
        if scale is not None:  # Dr.GRPO: each sequence's token sum over the constant, then the sequence mean
            total = total / scale
        return _divide(total, denom)

    ref = None
    if ref_log_prob is not None:  # KL(theta || reference) on every valid token (not only the policy term's)
        rlp = vt.take(ref_log_prob).detach().to(dtype)
        bad = torch.cat([bad, nonfinite_counts(vt.valid, rlp)])  # read_loss_stats raises on it
        on = valid & torch.isfinite(rlp)
        kl_tok = torch.where(on, kl_penalty(torch.where(on, lp, zero), torch.where(on, rlp, zero), kl_type), zero)
        ref = (aggregate(kl_tok).detach(), torch.where(on, lp.detach() - rlp, zero))
        tok = tok + float(kl_coef) * kl_tok
    else:
        bad = torch.cat([bad, bad.new_zeros(1)])
    if entropy_coeff:
        ent = vt.take(entropy).to(dtype)
        tok = tok - float(entropy_coeff) * torch.where(valid & torch.isfinite(ent.detach()), ent, zero)
    loss = aggregate(tok)

    values = _stats(loss, lr_d, valid, n, n_seqs, tr, keep, clipped, dual, bad, dropped, ref)
    return loss, LossStats(values=values, where=where, has_seqs=vt.known_seqs, has_opsm=dropped is not None,
                           has_ref=ref is not None)


@torch.no_grad()
def _stats(loss, lr, valid, n, n_seqs, tr, keep, clipped, dual, bad, dropped=None, ref=None) -> Tensor:
    """The device vector of LossStats (see _STATS); every sum masked to the valid tokens."""
    f64 = torch.float64
    lr64 = lr.to(f64)
    v = lr64.square()
    kept_tr = tr & keep
    r = torch.exp(lr).to(f64)
    inf = torch.full_like(r, math.inf)
    kept = valid & keep & ~clipped & ~dual
    if dropped is not None:
        kept = kept & ~dropped

    def extreme(where, fill, fn):  # min or max of r over `where`; +-inf when empty (as for no tokens)
        if not r.numel():
            return torch.tensor(math.inf if fn is torch.min else -math.inf, dtype=f64, device=r.device)
        return fn(torch.where(where, r, fill))

    rmin, rmax = extreme(valid, inf, torch.min), extreme(valid, -inf, torch.max)
    kmin, kmax = extreme(kept, inf, torch.min), extreme(kept, -inf, torch.max)
    zero = torch.zeros((), dtype=f64, device=r.device)
    return torch.cat([torch.stack([
        loss.detach().to(f64),
        (v * tr).sum(), tr.sum().to(f64),
        (v * kept_tr).sum(), kept_tr.sum().to(f64),
        (~keep & valid).sum().to(f64), clipped.sum().to(f64), dual.sum().to(f64),
        torch.where(valid, r, zero).sum(), rmin, rmax, (-lr64).sum(), torch.where(valid, r - 1 - lr64, zero).sum(),
        n.to(f64), (n_seqs if n_seqs is not None else torch.full((), -1, device=r.device)).to(f64), kmin, kmax,
        dropped.sum().to(f64) if dropped is not None else zero,
        *(_ref_sums(ref, valid) if ref is not None else (zero, zero, zero)),
    ]), bad.to(f64)])


def _ref_sums(ref, valid) -> tuple[Tensor, Tensor, Tensor]:
    """(the aggregated KL term, sum of log(theta/ref), sum of its k3) over the valid tokens."""
    kl_agg, lr = ref
    lr = lr.to(torch.float64)
    k3 = torch.where(valid, torch.exp(-lr) - 1 + lr, torch.zeros_like(lr))
    return kl_agg.to(torch.float64), lr.sum(), k3.sum()


def _metrics_from_row(row: list[float], has_seqs: bool, has_opsm: bool = False,
                      has_ref: bool = False) -> dict[str, float]:
    (loss_v, sv, nt, sv_kept, n_kept, n_masked, n_clip, n_dual, rsum, rmin, rmax, k1, k3, n,
     n_seqs, kmin, kmax, n_opsm, kl_loss, ref_k1, ref_k3) = row[:len(_STATS)]

    def mean(s, c):
        return s / c if c > 0 else 0.0

    out = {
        "loss": loss_v,
        "m2po/m2_before": mean(sv, nt),
        "m2po/m2_after": mean(sv_kept, n_kept),
        "m2po/masked_frac": mean(n_masked, n),
        "m2po/num_trust_region": nt,
        "clip_frac": mean(n_clip, n),
        "dual_clip_frac": mean(n_dual, n),
        "ratio/mean": mean(rsum, n),
        "ratio/min": rmin if n else math.inf,
        "ratio/max": rmax if n else -math.inf,
        "ratio/kept_min": kmin,
        "ratio/kept_max": kmax,
        "kl/k1": mean(k1, n),
        "kl/k3": mean(k3, n),
        "count/tokens": float(n),
        "count/kept_trust_region": n_kept,
    }
    if has_seqs:
        out["count/seqs"] = float(n_seqs)
    if has_opsm:
        out["opsm/masked_frac"] = mean(n_opsm, n)
    if has_ref:
        out.update({"kl_loss": kl_loss, "kl_ref/k1": mean(ref_k1, n), "kl_ref/k3": mean(ref_k3, n)})
    return out
