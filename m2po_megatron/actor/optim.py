"""The actor's DDP wrap, Megatron optimizer and LR/WD scheduler (one scheduler step per optimizer update)."""
from __future__ import annotations

from typing import Optional

import torch

from .grad_norm import use_fused_grad_norm


def wrap_ddp(chunks: list, config, use_distributed_optimizer: bool) -> list:
    """megatron-core's DDP around each bare chunk: gradients reduced in fp32, without overlapping compute,
    checked for NaN."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
        use_distributed_optimizer=use_distributed_optimizer, check_for_nan_in_grad=True, bucket_size=None)
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=c) for c in chunks]


def build_optimizer(model: list, config, params_dtype: str, optim: dict, *, use_distributed_optimizer: bool,
                    warmup_updates: int, lr_decay_steps: Optional[int], lr_schedule: str):
    """Megatron's optimizer over the DDP chunks and its scheduler; wires the TransformerConfig's gradient hooks.
    Returns (OptimizerConfig, optimizer, scheduler)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    bf16 = params_dtype == "bf16"
    opt_config = OptimizerConfig(**optim, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                                 use_distributed_optimizer=use_distributed_optimizer)
    optimizer = get_megatron_optimizer(opt_config, model)
    use_fused_grad_norm(optimizer)  # one multi-tensor norm and one host read per update
    lr, min_lr, wd = optim["lr"], optim["min_lr"], optim["weight_decay"]
    decay_steps = int(lr_decay_steps or max(1, warmup_updates) + 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup_updates else lr, max_lr=lr, min_lr=min_lr,
        lr_warmup_steps=int(warmup_updates), lr_decay_steps=max(decay_steps, int(warmup_updates) + 1),
        lr_decay_style=lr_schedule, start_wd=wd, end_wd=wd, wd_incr_steps=max(1, decay_steps),
        wd_incr_style="constant")
    config.no_sync_func = model[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return opt_config, optimizer, scheduler
