"""Per-token estimators of KL(pi_theta || pi_ref) from the sampled tokens' log-probs (Schulman, "Approximating
KL divergence", 2020), under verl's names (`algo.kl_loss_type`, verl's `kl_loss_type` and `kl_penalty`).

With d = log_prob - ref_log_prob for a token sampled from pi_theta:
    k1 ("kl"):         d                                   unbiased value, high variance, can be negative
    abs:               |d|
    k2 ("mse"):        d^2 / 2                             biased value; its gradient d is the KL's, in expectation
    k3 ("low_var_kl"): exp(-d) - 1 + d, with -d clamped to [-20, 20] and the result to [-10, 10]
                                                           unbiased value, low variance, >= 0
A "+" suffix ("k3+", "k1+", ...) keeps the type's value and takes k2's gradient (a straight-through term):
k1's and k3's expected gradients are not the KL's, k2's is (see docs/algo.md, "KL to a reference model").

Values and gradients are verl's (tests/algo/test_kl.py runs verl's own functions). One deliberate difference:
k3 is computed as expm1(-d) + d rather than exp(-d) - (-d) - 1. Same gradient; the value differs by rounding
only, and keeps its accuracy where pi_theta is near pi_ref (early in training), where exp(x) - 1 in float32
leaves rounding noise of ~1e-7 that swamps a KL of ~1e-8 and can even turn it negative.

Pure tensor math: no masking, no aggregation (the caller masks and aggregates as for the policy loss).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

# verl's spellings; each maps to the canonical k-name (kl is k1, mse is k2, low_var_kl is k3)
_BASE = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
KL_TYPES: tuple[str, ...] = tuple(_BASE) + tuple(f"{n}+" for n in _BASE)

# k3's guards, verl's: the log-ratio before the exp (exp(20) ~ 5e8 stays finite in bf16/fp32) and the value
_K3_LOG_RATIO_CLAMP = 20.0
_K3_VALUE_CLAMP = 10.0


def check_kl_type(name: str) -> str:
    """The canonical name ("k1", "k2", "k3", "abs", or one of them with "+") of any name in KL_TYPES; a ValueError
    naming KL_TYPES otherwise. "k2+" and "mse+" are plain "k2" (its gradient is already k2's)."""
    if name == "full":
        raise ValueError("kl_loss_type 'full' is the exact KL over the whole vocabulary: it needs both models' full "
                         "distributions at every position, and only the sampled tokens' log-probs reach the loss "
                         "(verl raises NotImplementedError for it too); use one of the per-token estimators: "
                         + ", ".join(KL_TYPES))
    base, plus = (name[:-1], "+") if isinstance(name, str) and name.endswith("+") else (name, "")
    if base not in _BASE:
        raise ValueError(f"kl_loss_type {name!r} is not one of: {', '.join(KL_TYPES)} (verl's names; e.g. "
                         f"low_var_kl, the default)")
    canon = _BASE[base]
    return canon if canon == "k2" else canon + plus


def _estimate(d: Tensor, canon: str) -> Tensor:
    if canon == "k1":
        return d
    if canon == "abs":
        return d.abs()  # torch's sign(0) = 0: zero gradient where the policies agree
    if canon == "k2":
        return 0.5 * d.square()
    x = (-d).clamp(-_K3_LOG_RATIO_CLAMP, _K3_LOG_RATIO_CLAMP)  # log(pi_ref / pi_theta)
    return (torch.expm1(x) - x).clamp(-_K3_VALUE_CLAMP, _K3_VALUE_CLAMP)


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kl_type: str) -> Tensor:
    """Per-token KL estimate, the shape of log_prob; differentiable in log_prob only (ref_log_prob is detached).

    Every position is computed: pass finite values in padding, or select with torch.where afterwards (k1 of a
    -inf reference log-prob is +inf, and 0 * inf is NaN)."""
    canon = check_kl_type(kl_type)
    if log_prob.shape != ref_log_prob.shape:
        raise ValueError(f"kl_penalty: log_prob {tuple(log_prob.shape)} and ref_log_prob "
                         f"{tuple(ref_log_prob.shape)} must have the same shape (one value per token)")
    d = log_prob - ref_log_prob.detach()
    if not canon.endswith("+"):
        return _estimate(d, canon)
    # straight-through: the value of the type, the gradient of k2 (k2 - k2.detach() is exactly 0 in value)
    k2 = 0.5 * d.square()
    return k2 - k2.detach() + _estimate(d.detach(), canon[:-1])
