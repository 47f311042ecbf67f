"""Streaming writer of HF sharded safetensors. Shards are planned from names, shapes and dtypes up front, so
each shard's header (with every tensor's offsets) is written when its first tensor arrives and each tensor's
bytes go to disk as it arrives: memory holds one tensor, never a shard. The files are standard safetensors
(8-byte little-endian header length, JSON header, then the tensors' bytes back to back in header order)."""
from __future__ import annotations

import json
import math
import os
import struct

import torch

from m2po_megatron.models.hf_checkpoint import SAFETENSORS_DTYPES

def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


class ShardedSafetensorsWriter:
    """add(name, tensor) in the planned order; close() writes the index. `plan`: (name, shape, dtype) per
    tensor; arriving tensors must match it exactly."""

    def __init__(self, out_dir: str, plan: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_bytes: int):
        self.out_dir = out_dir
        self.spec = {name: (tuple(shape), dtype) for name, shape, dtype in plan}
        shards: list[list[str]] = [[]]
        size = 0
        for name, shape, dtype in plan:
            nbytes = _nbytes(shape, dtype)
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += nbytes
        n = len(shards)
        self.files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.shards = shards
        self.order = [name for s in shards for name in s]
        self.file_of = {name: self.files[i] for i, s in enumerate(shards) for name in s}
        self.first_of_shard = {s[0]: i for i, s in enumerate(shards) if s}
        self.total_bytes = sum(_nbytes(*self.spec[n]) for n in self.order)
        self._pos = 0
        self._file = None

    def _header(self, names: list[str]) -> bytes:
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name in names:
            shape, dtype = self.spec[name]
            end = offset + _nbytes(shape, dtype)
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
            offset = end
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        return struct.pack("<Q", len(raw)) + raw

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._pos >= len(self.order) or self.order[self._pos] != name:
            want = self.order[self._pos] if self._pos < len(self.order) else "nothing"
            raise ValueError(f"tensor {name!r} arrived out of plan (expected {want})")
        shape, dtype = self.spec[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"tensor {name!r} is {list(tensor.shape)} {tensor.dtype}; the plan says "
                             f"{list(shape)} {dtype}")
        if name in self.first_of_shard:
            self._close_file()
            i = self.first_of_shard[name]
            self._file = open(os.path.join(self.out_dir, self.files[i]), "wb")
            self._file.write(self._header(self.shards[i]))
        self._pos += 1
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> None:
        self._close_file()
        if self._pos != len(self.order):
            raise ValueError(f"{len(self.order) - self._pos} planned tensors never arrived, "
                             f"first: {self.order[self._pos]}")
        index = {"metadata": {"total_size": self.total_bytes},
                 "weight_map": {n: self.file_of[n] for n in sorted(self.file_of)}}
        with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
