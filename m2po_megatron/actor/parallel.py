"""torch.distributed + Megatron model-parallel setup for one actor rank.

Reads the torchrun/Ray-style environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), picks the
backend from m2po_megatron.infra.device, and on CPU turns on the compatibility layer before Megatron is touched."""
from __future__ import annotations

import datetime
import os

from m2po_megatron.infra.device import dist_backend, has_cuda, select_gpu


def check_parallel_sizes(world_size: int, tensor_model_parallel_size: int = 1,
                         pipeline_model_parallel_size: int = 1, context_parallel_size: int = 1,
                         virtual_pipeline_model_parallel_size: int | None = None,
                         expert_model_parallel_size: int = 1, expert_tensor_parallel_size: int | None = None) -> int:
    """Validate the layout; returns the data-parallel size. Pure arithmetic, no distributed state."""
    for name, v in (("tensor_model_parallel_size", tensor_model_parallel_size),
                    ("pipeline_model_parallel_size", pipeline_model_parallel_size),
                    ("context_parallel_size", context_parallel_size), ("world_size", world_size)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if world_size % model_parallel:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size * "
            f"pipeline_model_parallel_size * context_parallel_size = {tensor_model_parallel_size} * "
            f"{pipeline_model_parallel_size} * {context_parallel_size} = {model_parallel}; "
            f"use a world size that is a multiple of {model_parallel} or change the parallel sizes")
    if virtual_pipeline_model_parallel_size is not None:
        if virtual_pipeline_model_parallel_size < 1:
            raise ValueError("virtual_pipeline_model_parallel_size must be >= 1 or None")
        if virtual_pipeline_model_parallel_size > 1 and pipeline_model_parallel_size < 2:
            raise ValueError("virtual_pipeline_model_parallel_size > 1 needs pipeline_model_parallel_size >= 2")
    expert = expert_model_parallel_size * (expert_tensor_parallel_size or tensor_model_parallel_size)
    stage = world_size // pipeline_model_parallel_size
    if expert_model_parallel_size < 1 or (expert_tensor_parallel_size or 1) < 1:
        raise ValueError("expert_model_parallel_size and expert_tensor_parallel_size must be >= 1")
    if stage % expert:
        raise ValueError(f"the {stage} ranks of a pipeline stage are not divisible by expert_tensor_parallel_size x "
                         f"expert_model_parallel_size = {expert}; choose expert sizes whose product divides them")
    return world_size // model_parallel


def init_distributed(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                     virtual_pipeline_model_parallel_size: int | None = None, context_parallel_size: int = 1,
                     seed: int = 1234, timeout_s: float = 1800.0, expert_model_parallel_size: int = 1,
                     expert_tensor_parallel_size: int | None = None) -> int:
    """Initialize torch.distributed (if not yet) and Megatron's parallel state; returns the data-parallel size.

    Environment: RANK, WORLD_SIZE (default 0/1), MASTER_ADDR (default 127.0.0.1), MASTER_PORT (required when
    WORLD_SIZE > 1), LOCAL_RANK (the index of this rank's GPU among those the process sees, default 0; Ray
    ranks get it from device.local_gpu_index). Backend: NCCL with CUDA, gloo otherwise (with the
    CPU compatibility layer activated in the calling thread)."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dp = check_parallel_sizes(world_size, tensor_model_parallel_size, pipeline_model_parallel_size,
                              context_parallel_size, virtual_pipeline_model_parallel_size,
                              expert_model_parallel_size, expert_tensor_parallel_size)
    if has_cuda():
        select_gpu(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        from m2po_megatron.actor import cpu_compat

        cpu_compat.activate()

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if world_size > 1 and "MASTER_PORT" not in os.environ:
            raise ValueError("MASTER_PORT is not set; set MASTER_ADDR/MASTER_PORT (torchrun does) for WORLD_SIZE > 1")
        timeout = datetime.timedelta(seconds=timeout_s)
        if world_size == 1 and "MASTER_PORT" not in os.environ:  # one process: an in-memory store, no port
            dist.init_process_group(backend=dist_backend(), store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
        else:
            dist.init_process_group(backend=dist_backend(), rank=rank, world_size=world_size, timeout=timeout)
    elif dist.get_world_size() != world_size:
        raise ValueError(f"torch.distributed is initialized with world size {dist.get_world_size()} but "
                         f"WORLD_SIZE={world_size}")

    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    vpp = virtual_pipeline_model_parallel_size if (virtual_pipeline_model_parallel_size or 1) > 1 else None
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        distributed_timeout_minutes=max(1, int(timeout_s // 60)),
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return dp


def destroy_distributed() -> None:
    """Tear down Megatron's parallel state and the default process group (safe to call twice)."""
    import torch.distributed as dist

    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


