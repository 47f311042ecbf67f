"""The one place that decides where tensors live and which collective backend to use.

Everything else asks here: CUDA present -> NCCL on the local GPU; otherwise CPU with gloo (the embedded
default and the test machines). `local_gpu_index` says which GPU a rank owns (from what Ray assigned it),
`select_gpu` makes it the current device."""
from __future__ import annotations

import functools
import os


@functools.cache
def has_cuda() -> bool:
    if os.environ.get("M2PO_FORCE_CPU") == "1":
        return False
    import torch

    return torch.cuda.is_available()


_rehearsal = False


def set_rehearsal(on: bool) -> None:
    """m2po rehearse: this process traces a GPU rank on fake CPU tensors (m2po_megatron.rehearse). The one thing
    it changes: the actor accepts the GPU's bf16 params without CUDA (no bf16 arithmetic runs on fake tensors)."""
    global _rehearsal
    _rehearsal = bool(on)


def rehearsing() -> bool:
    return _rehearsal


def dist_backend() -> str:
    return "nccl" if has_cuda() else "gloo"


def device():
    import torch

    if has_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_gpu_index(ray_gpu_ids=(), cuda_visible_devices: str | None = None, local_rank: int = 0) -> int:
    """The index, in this process's CUDA numbering, of the GPU a trainer rank owns. Pure.

    Under Ray a rank with num_gpus=1 is assigned one GPU id (`ray.get_gpu_ids()`, the node's numbering) and
    Ray sets CUDA_VISIBLE_DEVICES to the assigned ids, so the rank sees its GPU as index 0; where the process
    sees more GPUs (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES), the index is the id's position in
    CUDA_VISIBLE_DEVICES, or the id itself when that is unset. Never the global rank: a rank above 0 would
    select a device its process cannot see. Without Ray GPU ids: torchrun's LOCAL_RANK."""
    ids = [str(i).strip() for i in (ray_gpu_ids or ())]
    if not ids:
        return int(local_rank)
    if len(ids) != 1:
        raise ValueError(f"a trainer rank must own exactly one GPU; Ray assigned {ids} (use num_gpus=1 per rank)")
    gid = ids[0]
    if not (cuda_visible_devices or "").strip():
        return int(gid)
    visible = [v.strip() for v in cuda_visible_devices.split(",") if v.strip()]
    if gid not in visible:
        raise ValueError(f"Ray assigned GPU {gid}, which is not in CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}")
    return visible.index(gid)


def select_gpu(index: int) -> None:
    """Make GPU `index` current; an index this process cannot see is an error here (torch.cuda.set_device
    accepts it silently and the failure comes later)."""
    import torch

    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise RuntimeError(f"LOCAL_RANK={index} but this process sees {count} GPU(s) "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); the launcher must "
                           f"set LOCAL_RANK to the index of the rank's own GPU")
    torch.cuda.set_device(index)
