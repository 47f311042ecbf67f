"""The actor's checkpoints: initial weights (HF directory or Megatron dist checkpoint), and save/resume of a
whole trainer state (model, optimizer, scheduler, RNG, update count) as a Megatron dist checkpoint.

A checkpoint loads at another TP/PP/DP layout; the RNG states are then re-seeded instead of restored. `actor`
below is a MegatronActor (actor.py, which imports this module: the type is not imported back)."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from . import torch_adam


def has_hf_weights(path: str) -> bool:
    return os.path.isdir(path) and any(f.endswith(".safetensors") for f in os.listdir(path))


def load_initial_weights(chunks: list, src: Any, spec) -> None:
    """Weights into the bare model chunks (before DDP and the optimizer copy them): from a Megatron dist
    checkpoint (model only), an HF directory, or an in-memory transformers model / {hf_name: tensor} (tests)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from m2po_megatron.models import load_hf_weights

    if isinstance(src, (str, os.PathLike)):
        src = os.fspath(src)
        if dist_checkpointing.check_is_distributed_checkpoint(src):
            sd = {"model": chunks[0].sharded_state_dict()}
            loaded = dist_checkpointing.load(sd, src, strict=StrictHandling.ASSUME_OK_UNEXPECTED)
            chunks[0].load_state_dict(loaded["model"])
            return
        if not has_hf_weights(src):
            raise FileNotFoundError(f"load_from={src!r} is neither an HF model directory with *.safetensors "
                                    "nor a Megatron dist checkpoint (metadata.json)")
    load_hf_weights(chunks, src, spec)


def sharded_state_dict(actor: Any, is_loading: bool) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model_sd = actor.model_chunks()[0].sharded_state_dict()
    sd: dict[str, Any] = {"model": model_sd}
    meta = {"distrib_optim_sharding_type": "fully_reshardable"}
    try:
        sd["optimizer"] = actor.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=meta)
    except TypeError:  # non-distributed optimizers take no metadata
        sd["optimizer"] = actor.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    sd["opt_param_scheduler"] = actor.scheduler.state_dict()
    sd["updates_applied"] = actor.updates_applied
    ps = actor.ps
    # RNG states per (PP, TP) position; restored only when the layout is unchanged.
    rng = {"torch": torch.get_rng_state(),
           "tracker": _rng_tracker().get_states()}
    sd["rng_state"] = ShardedObject(
        "rng_state", rng, (actor.pp_size, actor.tp_size),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=actor.dp_rank)
    sd["layout"] = {"tp": actor.tp_size, "pp": actor.pp_size,
                    "use_distributed_optimizer": actor.use_distributed_optimizer}
    return sd


def save(actor: Any, path: str) -> None:
    from megatron.core import dist_checkpointing

    os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sharded_state_dict(actor, is_loading=False), path)
    dist.barrier()


def load(actor: Any, path: str) -> None:
    from megatron.core import dist_checkpointing

    if not dist_checkpointing.check_is_distributed_checkpoint(path):
        raise FileNotFoundError(f"{path!r} is not a Megatron dist checkpoint (no metadata.json)")
    layout = dist_checkpointing.load_common_state_dict(path).get("layout") or {}
    saved_distopt = layout.get("use_distributed_optimizer", actor.use_distributed_optimizer)
    if saved_distopt != actor.use_distributed_optimizer:
        raise ValueError(f"{path} was saved with use_distributed_optimizer={saved_distopt}; megatron cannot load "
                         f"its optimizer state into the other kind: set parallel.use_distributed_optimizer="
                         f"{str(saved_distopt).lower()} to resume from it")
    same_layout = (layout.get("tp"), layout.get("pp")) == (actor.tp_size, actor.pp_size)
    torch_adam.ensure_state(actor.optimizer)
    sd = sharded_state_dict(actor, is_loading=True)
    if not same_layout:
        sd.pop("rng_state")
    loaded = dist_checkpointing.load(sd, path)
    actor.model_chunks()[0].load_state_dict(loaded["model"])
    torch_adam.load_state_dict(actor.optimizer, loaded["optimizer"])
    actor.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    actor.updates_applied = int(loaded["updates_applied"])
    if same_layout and "rng_state" in loaded:
        torch.set_rng_state(loaded["rng_state"]["torch"])
        _rng_tracker().set_states(loaded["rng_state"]["tracker"])


def _rng_tracker():
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker()
