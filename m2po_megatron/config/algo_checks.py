"""The checks of the objective's own terms (docs/algo.md), apart from validation.py's general ones: dual
clipping, CISPO, off-policy sequence masking, Dr.GRPO's constant, the KL to the reference model, the entropy."""
from __future__ import annotations

import math

from omegaconf import DictConfig


def check_algo_terms(a: DictConfig, errors: list[str]) -> None:
    """algo.*'s terms beyond the policy loss's choices (algo/cispo.py, seq_mask.py, aggregation.py, kl.py)."""
    if a.dual_clip_c is not None and a.dual_clip_c <= 1:
        errors.append(f"algo.dual_clip_c = {a.dual_clip_c} must be > 1 (e.g. 3.0), or null to disable")
    if a.name == "cispo" and a.dual_clip_c is not None:
        errors.append(f"algo.dual_clip_c = {a.dual_clip_c} does not apply to algo.name = cispo (its weight is already "
                      f"capped at 1 + algo.cispo.eps_clip_high); set algo.dual_clip_c=null")
    agg = a.gspo.loss_agg_mode if a.name == "gspo" else a.loss_agg_mode
    if a.loss_scale_factor is not None:
        if not a.loss_scale_factor > 0:
            errors.append(f"algo.loss_scale_factor = {a.loss_scale_factor} must be > 0 (e.g. the maximum response "
                          f"length), or null for rollout.max_new_tokens")
        elif agg != "seq-mean-token-sum-norm":
            errors.append(f"algo.loss_scale_factor = {a.loss_scale_factor} applies to loss_agg_mode="
                          f"seq-mean-token-sum-norm only, not {agg}; set it to null or change the mode")
    if a.use_opsm and not math.isfinite(a.opsm_delta):
        errors.append(f"algo.opsm_delta = {a.opsm_delta} must be a finite threshold (slime's default 1e-4)")
    from m2po_megatron.algo.kl import check_kl_type  # KL to the reference model (algo/kl.py)

    try:
        check_kl_type(a.kl_loss_type)
    except ValueError as e:
        errors.append(f"algo.{e}")
    if not (math.isfinite(a.kl_loss_coef) and a.kl_loss_coef >= 0):
        errors.append(f"algo.kl_loss_coef = {a.kl_loss_coef} must be finite and >= 0 (verl's default 0.001)")
    if not math.isfinite(a.entropy_coeff):
        errors.append(f"algo.entropy_coeff = {a.entropy_coeff} must be finite (verl's default 0; > 0 rewards "
                      f"entropy)")
    if a.use_kl_in_reward:
        try:
            check_kl_type(a.kl_penalty)
        except ValueError as e:
            errors.append(f"algo.kl_penalty: {e}")
        if a.kl_ctrl.type != "fixed":
            errors.append(f"algo.kl_ctrl.type = {a.kl_ctrl.type!r}: only 'fixed' is supported (verl's adaptive "
                          f"controller keeps state across steps that a resumed run would lose); set "
                          f"algo.kl_ctrl.type=fixed and choose algo.kl_ctrl.kl_coef")
        if not (math.isfinite(a.kl_ctrl.kl_coef) and a.kl_ctrl.kl_coef >= 0):
            errors.append(f"algo.kl_ctrl.kl_coef = {a.kl_ctrl.kl_coef} must be finite and >= 0 (verl's default "
                          f"0.001)")
        if a.overlong_filtering:
            errors.append("algo.use_kl_in_reward with algo.overlong_filtering: a filtered sample keeps its reward "
                          "in its group's baseline but has no reference log-probs for its penalty; turn one off")
