"""Trainer side of the colocated weight update (SGLang's update_weights_from_tensor; docs/colocate.md).

Colocated, each engine runs on the GPUs of rollout.tp_size x dp_size consecutive trainer ranks, and the first of
those ranks (its *sender*) hands the engine the full HF-named weights from the same GPU: CUDA IPC handles, so no
copy crosses a link (m2po_megatron/rollout/memory_occupation.py writes the wire form). The weights come from
the export iterator the distributed sync uses (convert/export.py: gathered over tensor-parallel ranks, each
later pipeline stage relayed to global rank 0), so global rank 0, which is engine 0's sender, has every bucket:
it updates its own engine bucket by bucket, keeping a host copy of each when there are other engines; then
it broadcasts the copies over the senders' group, and every other sender updates its engine with them. The
other senders take their part in the export (gathers, a stage's relay) before they listen, so the relay and
the broadcast never wait on each other. Each bucket is one update (one weight-update session) carrying the
version: nothing generates during a colocated update, so no request sees a half-updated engine."""
from __future__ import annotations

import time
from typing import Iterable, Optional

import torch

BucketList = list[tuple[str, torch.Tensor]]


class TensorWeightSync:
    """The updates one sender makes to its engine. `engine_ranks`: the engine's TP ranks (each gets the same
    handles: an IPC handle opens on any GPU of the node)."""

    def __init__(self, url: str, api_key: Optional[str], engine_ranks: int = 1, timeout_s: float = 600.0):
        self.url, self.api_key, self.engine_ranks, self.timeout_s = url.rstrip("/"), api_key, engine_ranks, timeout_s

    def send(self, bucket: BucketList, weight_version: str) -> int:
        """One bucket to the engine; returns its bytes. On CPU the tensors are cloned first: serialising moves a
        tensor's storage into shared memory, which must never happen to a live parameter."""
        from m2po_megatron.rollout.memory_occupation import serialize_named_tensors, update_weights_from_tensor

        named = [(n, t.detach() if t.is_cuda else t.detach().clone()) for n, t in bucket]
        wire = serialize_named_tensors(named)
        update_weights_from_tensor(self.url, self.api_key, [wire] * self.engine_ranks, str(weight_version),
                                   self.timeout_s)
        del named  # the engine has copied them: the request returned
        return sum(t.numel() * t.element_size() for _, t in bucket)


def send_all(sync: TensorWeightSync, buckets: Iterable[BucketList], weight_version: str,
             keep_copies: bool) -> tuple[dict, list[BucketList]]:
    """Rank 0: every bucket to its own engine; with `keep_copies`, host copies for the other senders.
    Returns (stats, copies)."""
    t0 = time.perf_counter()
    copies: list[BucketList] = []
    nbytes = ntensors = nbuckets = 0
    for bucket in buckets:
        nbytes += sync.send(bucket, weight_version)
        ntensors += len(bucket)
        nbuckets += 1
        if keep_copies:
            copies.append([(n, t.detach().to("cpu", copy=True)) for n, t in bucket])
    if nbuckets == 0:
        raise ValueError("the export iterator yielded no bucket; nothing to sync")
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "transfer_seconds": seconds, "bytes": nbytes,
            "gb_per_s": nbytes / 1e9 / max(seconds, 1e-9), "num_buckets": nbuckets, "num_tensors": ntensors,
            "weight_version": weight_version, "backend": "tensor"}, copies


def broadcast_copies(copies: list[BucketList], group, src: int, device) -> None:
    """Rank 0: each host copy to the other senders (header, then tensors), then an empty header."""
    import torch.distributed as dist

    for bucket in copies:
        dist.broadcast_object_list([[(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in bucket]],
                                   src=src, group=group, device=device)
        for _, t in bucket:
            dist.broadcast(t.to(device), src=src, group=group)
    dist.broadcast_object_list([[]], src=src, group=group, device=device)


def receive_and_send(sync: TensorWeightSync, group, src: int, device, weight_version: str) -> None:
    """Another sender: each bucket rank 0 broadcasts, to this sender's engine."""
    import torch.distributed as dist

    while True:
        header = [None]
        dist.broadcast_object_list(header, src=src, group=group, device=device)
        if not header[0]:
            return
        bucket = []
        for name, shape, dtype in header[0]:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            dist.broadcast(t, src=src, group=group)
            bucket.append((name, t))
        sync.send(bucket, weight_version)
