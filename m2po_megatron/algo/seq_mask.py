"""Off-policy sequence masking (DeepSeek-V3.2; slime's --use-opsm / --opsm-delta).

A sequence's divergence from the behaviour policy is the mean over its loss tokens of
    log pi_behav - log pi_theta        (k1 estimate of KL(pi_behav || pi_theta) on the behaviour's samples),
and a token with a negative advantage is dropped from the loss when its sequence's divergence exceeds delta:
    drop_t = (A_t < 0) and (seq_kl > delta).
With GRPO's per-sequence advantages that drops whole negative sequences; a per-token advantage drops only its
negative tokens, as slime's mask does. Dropped tokens add 0 to the loss and stay in its denominator (slime
multiplies the token losses by the mask and keeps its denominators). The divergence is taken against the
loss's behav_log_prob: the behaviour policy in the two-policy loss, the proximal one under a rollout correction
(slime: the trainer's recomputed log-probs unless --use-rollout-logprobs). It needs no communication: every
sequence lies inside one call.
"""

from __future__ import annotations

import math

import torch

from m2po_megatron.algo._layout import ValidTokens

Tensor = torch.Tensor

DEFAULT_DELTA = 1e-4  # slime's --opsm-delta


def check_delta(delta) -> float:
    if delta is None or isinstance(delta, bool) or not math.isfinite(float(delta)):
        raise ValueError(f"opsm_delta must be a finite threshold (slime's default {DEFAULT_DELTA}), got {delta!r}")
    return float(delta)


def opsm_drop(lr: Tensor, A: Tensor, valid: Tensor, vt: ValidTokens, delta: float) -> Tensor:
    """[N] bool: the valid tokens off-policy sequence masking drops. lr: detached log pi_theta - log pi_behav,
    zero off the valid tokens; sequences must be known (vt.known_seqs)."""
    count = vt.seq_sum(valid.to(lr.dtype)).clamp(min=1)
    seq_kl = vt.seq_sum(-lr) / count
    return valid & (A < 0) & (seq_kl[vt.seq] > delta)
