"""Tensor-by-tensor access to HF weights (safetensors directory, sharded with an index, or in memory) and the
checks that run before any conversion work: missing, unexpected and wrongly shaped tensors."""
from __future__ import annotations

import json
import os
import struct
from typing import Any, Mapping

import torch

from m2po_megatron.models.hf_config import HFModelSpec, read_hf_config
from m2po_megatron.models.weights import expected_hf_shapes

# Present in some checkpoints, never weights of the model.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointMismatchError(ValueError):
    """The HF tensors do not match the model described by config.json."""


class HFTensorSource:
    """Reads one HF tensor at a time. Build with `open_hf_source`."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], getter, config: Any = None, close=None):
        self._shapes = dict(shapes)
        self._get = getter
        self.config = config
        self._close = close

    def keys(self) -> list[str]:
        return list(self._shapes)

    def __contains__(self, name: str) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def get(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise CheckpointMismatchError(f"HF tensor {name!r} is missing from the checkpoint")
        return self._get(name)

    def close(self) -> None:
        if self._close:
            self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                      torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
                      torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}
_TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


class SafetensorsFile:
    """One .safetensors file read with plain file reads. safetensors' own reader maps the file, and every page
    it touches stays resident in the process for as long as the file is open: a conversion that reads every
    tensor once would look (and be accounted) as large as the checkpoint. Here a tensor costs its own bytes."""

    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "rb")
        try:
            (n,) = struct.unpack("<Q", self._f.read(8))
            header = json.loads(self._f.read(n))
        except (struct.error, ValueError) as e:
            self._f.close()
            raise CheckpointMismatchError(f"{path} is not a valid safetensors file ({e})") from None
        self._start = 8 + n
        self.meta = {k: v for k, v in header.items() if k != "__metadata__"}

    def keys(self) -> list[str]:
        return list(self.meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.meta[name]["shape"])

    def get_tensor(self, name: str) -> torch.Tensor:
        m = self.meta[name]
        if m["dtype"] not in _TORCH_DTYPES:
            raise CheckpointMismatchError(f"{self.path}: tensor {name!r} has dtype {m['dtype']}, which this reader "
                                          f"does not know ({sorted(_TORCH_DTYPES)})")
        t = torch.empty(m["shape"], dtype=_TORCH_DTYPES[m["dtype"]])
        begin, end = m["data_offsets"]
        if end - begin != t.nbytes:
            raise CheckpointMismatchError(f"{self.path}: tensor {name!r} has {end - begin} bytes for shape "
                                          f"{m['shape']} {m['dtype']} ({t.nbytes} expected); the file is corrupt")
        if t.nbytes:
            self._f.seek(self._start + begin)
            if self._f.readinto(memoryview(t.reshape(-1).view(torch.uint8).numpy())) != t.nbytes:
                raise CheckpointMismatchError(f"{self.path}: truncated while reading {name!r}")
        return t

    def close(self) -> None:
        self._f.close()


def _dir_source(path: str) -> HFTensorSource:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            bins = [f for f in os.listdir(path) if f.endswith(".bin") or f.endswith(".pt")]
            hint = " (found PyTorch .bin files; re-save with safe_serialization=True)" if bins else ""
            raise FileNotFoundError(f"no *.safetensors weights in {path}{hint}")
        weight_map = None
    handles = {}
    shapes, where = {}, {}
    for fn in files:
        full = os.path.join(path, fn)
        if not os.path.isfile(full):
            raise FileNotFoundError(f"weight file {full} listed in the index is missing")
        h = SafetensorsFile(full)
        handles[fn] = h
        for k in h.keys():
            shapes[k] = h.shape(k)
            where[k] = fn
    if weight_map is not None:
        missing = sorted(k for k, fn in weight_map.items() if where.get(k) != fn)
        if missing:
            raise CheckpointMismatchError(f"index lists tensors not found in their files: {missing[:10]}")
    cfg = os.path.join(path, "config.json")
    def close():
        for h in handles.values():
            h.close()
        handles.clear()

    return HFTensorSource(shapes, lambda n: handles[where[n]].get_tensor(n),
                          config=cfg if os.path.isfile(cfg) else None, close=close)


def on_disk_state_dict(model: torch.nn.Module) -> dict:
    """A transformers model's tensors under its checkpoint names. transformers 5 keeps some weights in another
    layout in memory than on disk (Qwen3-MoE's experts fused into [E, 2F, H] / [E, H, F]); its own
    `revert_weight_conversion`, which save_pretrained runs, gives them back per expert."""
    sd = model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: memory and disk agree
        return sd
    return revert_weight_conversion(model, sd) if hasattr(model, "config") else sd


def open_hf_source(source: Any) -> HFTensorSource:
    """A tensor source from a directory of safetensors, a transformers model, or a {name: tensor} mapping."""
    if isinstance(source, HFTensorSource):
        return source
    if isinstance(source, (str, os.PathLike)):
        return _dir_source(os.fspath(source))
    if isinstance(source, torch.nn.Module):
        sd = on_disk_state_dict(source)
        cfg = getattr(source, "config", None)
        return HFTensorSource({k: tuple(v.shape) for k, v in sd.items()}, sd.__getitem__, config=cfg)
    if isinstance(source, Mapping):
        return HFTensorSource({k: tuple(v.shape) for k, v in source.items()}, source.__getitem__)
    raise TypeError(f"cannot read HF weights from {type(source).__name__}")


def validate_hf_source(spec: HFModelSpec, src: HFTensorSource) -> None:
    """Raise CheckpointMismatchError naming every missing, unexpected or wrongly shaped tensor."""
    want = expected_hf_shapes(spec)
    have = set(src.keys())
    missing = [n for n in want if n not in have]
    unexpected = sorted(n for n in have - set(want) if not n.endswith(_IGNORABLE_SUFFIXES)
                        and not (spec.tie_word_embeddings and n == "lm_head.weight"))
    bad = [f"{n}: checkpoint {list(src.shape(n))} vs config {list(s)}" for n, s in want.items()
           if n in have and tuple(src.shape(n)) != tuple(s)]
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {', '.join(missing[:20])}"
                        + (" ..." if len(missing) > 20 else ""))
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {', '.join(unexpected[:20])}"
                        + (" ..." if len(unexpected) > 20 else ""))
    if bad:
        problems.append(f"shape mismatches ({len(bad)}): {'; '.join(bad[:20])}")
    if problems:
        raise CheckpointMismatchError(
            f"HF weights do not match the {spec.architecture} config: " + " | ".join(problems))


def spec_for(source: Any, hf_config: Any = None) -> HFModelSpec:
    """The model spec from an explicit config, else from the source (directory config.json / model.config)."""
    if hf_config is not None:
        return hf_config if isinstance(hf_config, HFModelSpec) else read_hf_config(hf_config)
    cfg = source.config if isinstance(source, HFTensorSource) else (
        source if isinstance(source, (str, os.PathLike)) else getattr(source, "config", None))
    if cfg is None:
        raise ValueError("pass hf_config: the weights source has no config")
    return read_hf_config(cfg)
