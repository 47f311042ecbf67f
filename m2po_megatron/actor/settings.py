"""The settings MegatronActor accepts: the choice lists config validation shows (config.validation.choices
imports them from here) and the checks the actor makes before any distributed or model work."""
from __future__ import annotations

from typing import Optional

LR_SCHEDULES = ("constant", "cosine", "linear")
M2PO_SCOPES = ("global", "microbatch")
RECOMPUTE_GRANULARITIES = (None, "selective", "full")


def check_options(*, micro_batch_tokens, context_parallel_size, virtual_pipeline_model_parallel_size, optimizer,
                   use_distributed_optimizer, lr_schedule, lr_decay_steps, m2po_scope, recompute_granularity,
                   recompute_method, loss_name) -> None:
    """Settings the actor refuses, checked before any distributed or model work."""
    if context_parallel_size != 1:
        raise NotImplementedError("context_parallel_size > 1 is not supported yet (packed rows would need "
                                  "per-sequence CP splitting); use tensor/pipeline/data parallelism")
    if (virtual_pipeline_model_parallel_size or 1) > 1:
        raise NotImplementedError("virtual pipeline parallelism is not supported by MegatronActor yet; "
                                  "set virtual_pipeline_model_parallel_size=None")
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer={optimizer!r}: use 'adam' (AdamW) or 'sgd'")
    if optimizer == "sgd" and use_distributed_optimizer:
        raise ValueError("megatron's distributed optimizer supports Adam only: with optimizer='sgd' set "
                         "use_distributed_optimizer=False")
    if lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule={lr_schedule!r}: use one of {LR_SCHEDULES}")
    if lr_schedule != "constant" and not lr_decay_steps:
        raise ValueError(f"lr_schedule={lr_schedule!r} needs lr_decay_steps (total optimizer updates)")
    if m2po_scope not in M2PO_SCOPES:
        raise ValueError(f"m2po_scope={m2po_scope!r}: use one of {M2PO_SCOPES}")
    if recompute_granularity not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"recompute_granularity={recompute_granularity!r}: use one of "
                         f"{RECOMPUTE_GRANULARITIES}")
    if recompute_granularity == "full" and recompute_method not in ("uniform", "block"):
        raise ValueError(f"recompute_method={recompute_method!r}: use 'uniform' or 'block'")
    if micro_batch_tokens < 2:
        raise ValueError(f"micro_batch_tokens={micro_batch_tokens} must be >= 2")
    from m2po_megatron.algo import losses as algo_losses

    if loss_name not in algo_losses.LOSSES:
        raise ValueError(f"loss_name={loss_name!r}: use one of {sorted(algo_losses.LOSSES)}")


def recompute_overrides(granularity: Optional[str], method: str, num_layers: int) -> dict:
    """Megatron's activation recompute: "selective" re-runs core attention in backward; "full" keeps only
    the input of every `num_layers`-layer chunk ("uniform") or of the first `num_layers` layers of each
    stage ("block") and re-runs the rest."""
    if granularity is None:
        return {}
    if granularity == "selective":
        return {"recompute_granularity": "selective"}
    return {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": int(num_layers)}
