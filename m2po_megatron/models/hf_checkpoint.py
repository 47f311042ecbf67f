"""Tensor-by-tensor access to HF weights (safetensors directory, sharded with an index, or in memory) and the
checks that run before any conversion work: missing, unexpected and wrongly shaped tensors."""
from __future__ import annotations

import json
import os
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


def _dir_source(path: str) -> HFTensorSource:
    from safetensors import safe_open

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
        h = safe_open(full, framework="pt", device="cpu")
        handles[fn] = h
        for k in h.keys():
            shapes[k] = tuple(h.get_slice(k).get_shape())
            where[k] = fn
    if weight_map is not None:
        missing = sorted(k for k, fn in weight_map.items() if where.get(k) != fn)
        if missing:
            raise CheckpointMismatchError(f"index lists tensors not found in their files: {missing[:10]}")
    cfg = os.path.join(path, "config.json")
    return HFTensorSource(shapes, lambda n: handles[where[n]].get_tensor(n),
                          config=cfg if os.path.isfile(cfg) else None, close=handles.clear)


def open_hf_source(source: Any) -> HFTensorSource:
    """A tensor source from a directory of safetensors, a transformers model, or a {name: tensor} mapping."""
    if isinstance(source, HFTensorSource):
        return source
    if isinstance(source, (str, os.PathLike)):
        return _dir_source(os.fspath(source))
    if isinstance(source, torch.nn.Module):
        sd = source.state_dict()
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
