"""Streaming writer of HF sharded safetensors: shard assignment is planned from shapes up front, then each
shard file is written as soon as its last tensor arrives, so at most one shard is held in memory."""
from __future__ import annotations

import json
import os

import torch


class ShardedSafetensorsWriter:
    """add(name, tensor) in the planned order; close() writes the index. Names must match the plan exactly."""

    def __init__(self, out_dir: str, plan: list[tuple[str, int]], max_shard_bytes: int):
        self.out_dir = out_dir
        shards: list[list[str]] = [[]]
        size = 0
        for name, nbytes in plan:
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += nbytes
        n = len(shards)
        self.files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.order = [name for s in shards for name in s]
        self.file_of = {name: self.files[i] for i, s in enumerate(shards) for name in s}
        self.last_of_shard = {s[-1]: i for i, s in enumerate(shards) if s}
        self.total_bytes = sum(b for _, b in plan)
        self._pos = 0
        self._buf: dict[str, torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        from safetensors.torch import save_file

        if self._pos >= len(self.order) or self.order[self._pos] != name:
            want = self.order[self._pos] if self._pos < len(self.order) else "nothing"
            raise ValueError(f"tensor {name!r} arrived out of plan (expected {want})")
        self._pos += 1
        self._buf[name] = tensor.detach().contiguous().cpu()
        if name in self.last_of_shard:
            fn = self.files[self.last_of_shard[name]]
            save_file(self._buf, os.path.join(self.out_dir, fn), metadata={"format": "pt"})
            self._buf = {}

    def close(self) -> None:
        if self._pos != len(self.order):
            raise ValueError(f"{len(self.order) - self._pos} planned tensors never arrived, "
                             f"first: {self.order[self._pos]}")
        index = {"metadata": {"total_size": self.total_bytes},
                 "weight_map": {n: self.file_of[n] for n in sorted(self.file_of)}}
        with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
