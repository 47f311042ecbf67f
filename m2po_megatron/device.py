"""The one place that decides where tensors live and which collective backend to use.

Everything else asks here: CUDA present -> NCCL on the local GPU; otherwise CPU with gloo (the embedded
default and the test machines)."""
from __future__ import annotations

import functools
import os


@functools.cache
def has_cuda() -> bool:
    if os.environ.get("M2PO_FORCE_CPU") == "1":
        return False
    import torch

    return torch.cuda.is_available()


def dist_backend() -> str:
    return "nccl" if has_cuda() else "gloo"


def device():
    import torch

    if has_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
