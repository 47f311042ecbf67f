"""The M2PO token mask: Algorithm 1 of the paper ("remove") and the released code's capped clip ("cap").

Notation (per valid token i): l_i = log pi_theta - log pi_behav (the log-ratio), A_i its advantage,
v_i = l_i^2. Trust-region tokens T = {A > 0 and l > 0} u {A < 0 and l < 0}; M2 = mean_{i in T} v_i.

remove (Algorithm 1): while M2 over the remaining T exceeds tau, drop the remaining T token with the largest
  v. Since dropping the largest value can only lower the mean, the greedy loop keeps exactly the m* smallest
  values of T, where m* = max{m in 0..|T| : v_(1) + ... + v_(m) <= tau * m} (v_(k) ascending). One stable
  sort + one cumulative sum finds m*, with no loop (keep_trust_region: no data-dependent shape and no host
  sync either; m2po_keep_mask selects T first, one sync per batch). Ties: among equal values the token that
  comes later in the batch order (row-major valid tokens; micro-batches in order; ranks in group order) is
  dropped first, in one process or many.

cap (released code, verl fork): if M2 <= tau (+1e-12) nothing is bounded. Otherwise find the first sorted
  index k with sum_i min(v_i, v_(k) - 1e-12) >= tau*|T| - 1e-12 and take the bound c^2 = v_(k-1) - 1e-12
  (c = 0 when k = 0), applied as a PPO clip with ratio bounds [e^-c, e^c]. Its zero-gradient set is the T
  tokens with v >= v_(k-1) (v > c^2; the strict form keeps the rule defined where v_(k-1) < 1e-12), which
  always contains the remove set (k <= m*); on tokens both keep the gradients agree (r*A).
  tests/algo/test_released_oracle.py runs the released function itself against this rule; docs/algo.md
  lists what remains different (in float32 the boundary token typically gets half its gradient there, the
  float32 trust region, the 1e5 ratio cap without a bound, its crashes).

Values are squared in float64 (exact for float32 log-ratios), so sums compare deterministically and the
distributed version (distributed.py) reproduces the single-process mask bit for bit.
"""

from __future__ import annotations

import math

import torch

from m2po_megatron.algo._layout import as_bool_mask, check_finite, check_same_shape

Tensor = torch.Tensor

RULES = ("remove", "cap")
# The tokens whose second moment is bounded: T (Algorithm 1, the released code, ms-swift's and Trinity-RFT's
# ports) or every valid token (AReaL's port); docs/algo.md compares them.
M2_TOKENS = ("trust_region", "all")
CAP_TOL = 1e-12  # the tolerance the released code uses in its comparisons


def check_tau_rule(tau: float, rule: str) -> None:
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau >= 0):
        raise ValueError(f"tau must be a finite number >= 0 (the paper uses 0.04), got {tau!r}")


def trust_region(log_ratio: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """Bool tensor: valid tokens in the two trust-region quadrants (A > 0 and r > 1) or (A < 0 and r < 1)."""
    return mask & (((advantages > 0) & (log_ratio > 0)) | ((advantages < 0) & (log_ratio < 0)))


def check_m2_tokens(tokens: str) -> None:
    if tokens not in M2_TOKENS:
        raise ValueError(f"m2_tokens must be one of {M2_TOKENS}, got {tokens!r}")


def bounded_tokens(log_ratio: Tensor, advantages: Tensor, mask: Tensor, tokens: str = "trust_region") -> Tensor:
    """The tokens whose M2 the mask bounds (and whose values it may drop): the trust region T, or with
    tokens="all" every valid token."""
    check_m2_tokens(tokens)
    return trust_region(log_ratio, advantages, mask) if tokens == "trust_region" else mask.clone()


def _squares(tr_log_ratio: Tensor) -> Tensor:
    # float64 square of a float32 value is exact (24-bit mantissa -> 48 bits).
    return tr_log_ratio.to(torch.float64).square()


def remove_keep_count(sorted_v: Tensor, tau: float) -> Tensor:
    """m* for ascending float64 values: the largest m with sum of the m smallest <= tau * m (0-d tensor).
    Entries past the trust region may be +inf (see keep_trust_region): their prefix sums are inf, never <=."""
    n = sorted_v.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.long, device=sorted_v.device)
    prefix = torch.cumsum(sorted_v, 0)
    m = torch.arange(1, n + 1, device=sorted_v.device)
    ok = prefix <= tau * m.to(torch.float64)
    # The greedy loop stops at the first (largest) m that satisfies the bound; take the max, not the count,
    # so the result is the greedy one even if rounding made the prefix means non-monotone.
    return torch.where(ok, m, torch.zeros_like(m)).max()


def cap_bound_sq(sorted_v: Tensor, tau: float, num_trust_region: Tensor | None = None) -> Tensor:
    """The bound of the released code's zero-gradient set for ascending float64 values: T tokens with
    v >= bound lose their gradient (0-d; +inf = no bound). Only the first `num_trust_region` values (a 0-d
    device tensor; default all) are T's; the rest may be anything (+inf in keep_trust_region)."""
    n = sorted_v.numel()
    dev = sorted_v.device
    if n == 0:
        return torch.tensor(math.inf, dtype=torch.float64, device=dev)
    n_t = torch.as_tensor(n if num_trust_region is None else num_trust_region, device=dev).long()
    nf = n_t.to(torch.float64)
    idx = torch.arange(n, device=dev)
    prefix = torch.cumsum(sorted_v, 0)
    total = prefix.gather(0, (n_t - 1).clamp(min=0).reshape(1)).squeeze(0)
    target = tau * nf
    # f_k = sum_i min(v_i, v_(k) - 1e-12) = prefix_k + (n - k - 1) * (v_(k) - 1e-12), as the released loop
    # computes it; non-decreasing in k.
    rest = nf - 1 - idx.to(torch.float64)
    f = prefix + rest * (sorted_v - CAP_TOL)
    reached = (idx < n_t) & (f >= target - CAP_TOL)
    k = torch.argmax(reached.to(torch.int8))  # first index where reached (f_{n-1} = total > target here)
    # Zero gradient for v >= v_(k-1) (the released v > v_(k-1) - 1e-12); k = 0 bounds every T token.
    prev = sorted_v.gather(0, (k - 1).clamp(min=0).reshape(1)).squeeze(0)
    c2 = torch.where(k == 0, torch.zeros_like(total), prev)
    # tau = 0 with M2 > 0: bound at ratio 1 (the released code crashes here)
    c2 = torch.where(target <= CAP_TOL, torch.zeros_like(c2), c2)
    no_bound = (n_t == 0) | (total / nf <= tau + CAP_TOL) | (target >= total - CAP_TOL)
    return torch.where(no_bound, torch.full_like(c2, math.inf), c2)


def keep_trust_region(log_ratio: Tensor, in_region: Tensor | None, tau: float, rule: str = "remove") -> Tensor:
    """Keep flags [N] for flat log-ratios [N] in batch order, of which `in_region` [N] marks the trust-region
    tokens T (None: all of them); True everywhere off T. The whole decision, with no data-dependent shape:
    tokens off T sort last (as +inf, stably), so the first |T| sorted values are exactly T's in the order a
    sort of T alone gives; m2po_keep_mask, policy_loss and the distributed version all decide through here,
    which is why they agree."""
    check_tau_rule(tau, rule)
    v = _squares(log_ratio.reshape(-1))
    n = v.numel()
    if n == 0:
        return torch.ones(0, dtype=torch.bool, device=v.device)
    if in_region is None:
        big, n_t = v, None
    else:
        in_region = in_region.reshape(-1)
        big, n_t = torch.where(in_region, v, torch.full_like(v, math.inf)), in_region.sum()
    if rule == "cap":
        keep = v < cap_bound_sq(torch.sort(big).values, tau, n_t)
    else:
        sorted_v, order = torch.sort(big, stable=True)
        keep_sorted = torch.arange(n, device=v.device) < remove_keep_count(sorted_v, tau)
        keep = torch.empty_like(keep_sorted)
        keep[order] = keep_sorted
    return keep if in_region is None else ~in_region | keep


def keep_trust_region_values(tr_log_ratio: Tensor, tau: float, rule: str = "remove") -> Tensor:
    """Keep flags for the trust-region tokens alone, given their log-ratios in batch order (1-D)."""
    return keep_trust_region(tr_log_ratio, None, tau, rule)


def m2po_keep_mask(
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    tau: float = 0.04,
    rule: str = "remove",
    tokens: str = "trust_region",
) -> Tensor:
    """M2PO keep mask over one batch (the tokens given here are the whole batch).

    Args:
        log_ratio: log pi_theta - log pi_behav per token, padded [B, T] or flat [N] (any float dtype; bf16 and
            fp16 are computed in float32). Not differentiated.
        advantages: per-token advantages, same shape (broadcast per-sequence advantages first).
        mask: valid tokens (bool or 0/1), same shape.
        tau: bound on the second moment M2 of the trust-region log-ratios (paper: 0.04).
        rule: "remove" (Algorithm 1, exact) or "cap" (the released code's zero-gradient set); see module doc.
        tokens: "trust_region" (T, the paper's) or "all" (every valid token: AReaL's port); see bounded_tokens.

    Returns:
        bool tensor of the same shape: True where the token is valid and not dropped.

    For the batch-level mask over micro-batches and data-parallel ranks use
    m2po_megatron.algo.distributed.global_m2po_keep_masks.
    """
    check_tau_rule(tau, rule)
    mask = as_bool_mask(mask, "mask")
    check_same_shape("log_ratio", log_ratio, advantages=advantages, mask=mask)
    check_finite("m2po_keep_mask", mask, log_ratio=log_ratio, advantages=advantages)
    with torch.no_grad():
        lr = log_ratio.detach()
        if lr.dtype in (torch.float16, torch.bfloat16):
            lr = lr.float()
        tr = bounded_tokens(lr, advantages.detach(), mask, tokens).reshape(-1)
        # A whole batch, once: sorting only T's values (one nonzero, one host sync) halves the sort and its
        # memory against keep_trust_region's padded form, which the per-micro-batch loss uses instead.
        idx = tr.nonzero().squeeze(-1)
        keep = mask.reshape(-1).clone()
        keep[idx] = keep_trust_region_values(lr.reshape(-1)[idx], tau, rule)
        return keep.reshape(mask.shape)
