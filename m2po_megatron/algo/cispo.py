"""CISPO (MiniMax-M1, arXiv 2506.13585): a clipped, stop-gradient importance weight on a REINFORCE term.

Per valid token, with r = exp(log_prob - behav_log_prob) and w = clip(r, 1 - eps_low, 1 + eps_high):
    loss_t = -sg(w) * A * log_prob,      d loss_t / d log_prob = -w * A.
Unlike the PPO clip no token leaves the gradient: a clipped token keeps the capped weight. The value is the
anchors' own (verl's compute_policy_loss_cispo, slime's compute_cispo_loss), so it depends on log_prob itself
and not only on the ratio; only the gradient is meaningful. verl clamps the log-ratio to [-20, 20] before the
exp; here the clip alone bounds w, which differs from verl only where r < exp(-20) and the lower bound is off.

Defaults (algo.cispo): eps_low = 1.0 (no lower bound: the paper "did not impose a lower bound", slime warns on
anything below 1.0, verl's CISPO example sets 10) and eps_high = 0.2 (verl's and slime's default and verl's
example). The dual clip does not apply: w is already capped (NeMo-RL refuses the combination as well).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

DEFAULT_EPS = (1.0, 0.2)  # (eps_low, eps_high)


def check_eps(eps_low: float, eps_high: float) -> None:
    """eps_low >= 0 (any value >= 1 removes the lower bound, since r > 0), eps_high >= 0."""
    if not (eps_low >= 0 and eps_high >= 0):
        raise ValueError(f"cispo needs eps_low >= 0 (>= 1: no lower bound) and eps_high >= 0, got "
                         f"eps_low={eps_low}, eps_high={eps_high}")


def cispo_surrogate(lp: Tensor, lr: Tensor, A: Tensor, active: Tensor, eps: tuple[float, float]
                    ) -> tuple[Tensor, Tensor]:
    """(per-token loss, clipped flags). lp: log_prob (differentiable, finite: zero off the valid tokens);
    lr: the log-ratios; A: advantages; active: the tokens that enter the loss (valid and not masked out by
    M2PO's mask or the off-policy sequence mask); everywhere else the loss is exactly 0."""
    r = torch.exp(lr.detach())
    w = r.clamp(1.0 - eps[0], 1.0 + eps[1])  # detached: the weight never carries gradient
    clipped = active & (w != r)
    tok = torch.where(active, -w * A * lp, torch.zeros_like(lp))
    return tok, clipped
