"""Megatron torch_dist checkpoints written and read a tensor (or a layer) at a time, for conversion.

Writing: a checkpoint of a model whose tensors are produced one at a time.

hf_to_megatron builds the GPTModel on the meta device (no memory), so `sharded_state_dict()` describes every
tensor (keys, global shapes, offsets, the swiglu split) without data. This save strategy is megatron's own
torch_dist strategy except for where the bytes come from: PyTorch's FileSystemWriter with one thread resolves
write items one after the other, and the planner below materialises each item from the HF checkpoint at that
moment (`materialize(meta_param)` -> the parameter's real tensor), so at most one parameter and its HF
sources are in memory, instead of the whole model. The files and metadata are those megatron writes, so
`dist_checkpointing.load` reads them at any TP/PP layout.

Reading: `read_chunks` fills given tensors with given chunks of stored tensors (one layer's slab of megatron's
stacked [layers, ...] tensors), through PyTorch's resharding reader, which megatron's own load cannot do for
part of a stacked tensor."""
from __future__ import annotations

from typing import Callable

import torch
from megatron.core.dist_checkpointing.strategies.torch import (MCoreSavePlanner, TorchDistSaveShardedStrategy,
                                                               _replace_state_dict_keys_with_sharded_keys,
                                                               mcore_to_pyt_state_dict)
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage: a parameter, its detached copies and all their views share it (meta
    tensors have no data pointer to compare)."""
    return t.untyped_storage()._cdata


class _MaterializingPlanner(MCoreSavePlanner):
    def __init__(self, params: dict[int, torch.Tensor], materialize: Callable[[torch.Tensor], torch.Tensor],
                 **kwargs):
        super().__init__(**kwargs)
        self.params, self.materialize = params, materialize
        self._last: tuple[int, torch.Tensor] | None = None  # the swiglu halves of fc1 come one after the other

    def lookup_object(self, index):
        obj = super().lookup_object(index)
        if not (torch.is_tensor(obj) and obj.is_meta):
            return obj
        key = storage_key(obj)  # obj is a view (layer axis, a swiglu half) of one meta parameter
        if key not in self.params:
            raise KeyError(f"{index.fqn}: not a view of a model parameter; cannot make its data")
        param = self.params[key]
        if self._last is None or self._last[0] != key:
            self._last = None  # drop the previous parameter before making the next
            self._last = (key, self.materialize(param))
        real = self._last[1]
        if tuple(real.shape) != tuple(param.shape) or real.stride() != param.stride():
            raise ValueError(f"{index.fqn}: materialised {list(real.shape)} with strides {real.stride()}, the model "
                             f"expects {list(param.shape)} with strides {param.stride()}")
        # the same view of the real tensor (a real shard may itself start inside a larger storage)
        return real.as_strided(obj.size(), obj.stride(),
                               real.storage_offset() + obj.storage_offset() - param.storage_offset())


class MaterializingTorchDistSave(TorchDistSaveShardedStrategy):
    """megatron's torch_dist save strategy, synchronous, with tensors made on demand: `materialize(p)` returns
    the real tensor of meta parameter `p` (one of `params`, contiguous, p's shape and dtype)."""

    def __init__(self, params, materialize: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__("torch_dist", 1, thread_count=1)
        self.params = {storage_key(p): p for p in params}
        self.materialize = materialize

    def save(self, sharded_state_dict, checkpoint_dir):
        import torch.distributed.checkpoint as dcp

        sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict,
                                                                              self.keep_only_main_replica)
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
        planner = _MaterializingPlanner(self.params, self.materialize,
                                        dedup_replicated_tensors=not self.keep_only_main_replica,
                                        flatten_state_dict=False, flatten_sharded_tensors=False)
        writer = dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1, single_file_per_rank=True)
        dcp.save(pyt_state_dict, storage_writer=writer, planner=planner)


class _ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads given chunks (fqn, global offsets, destination tensor of the chunk's size) of a DCP checkpoint,
    e.g. one layer's slab of a stacked [layers, ...] tensor, instead of whole state-dict entries."""

    def __init__(self, chunks: list[tuple[str, tuple[int, ...], torch.Tensor]]):
        super().__init__()
        self.chunks = {(fqn, tuple(off)): dest for fqn, off, dest in chunks}

    def create_local_plan(self) -> LoadPlan:
        items = []
        for (fqn, off), dest in self.chunks.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None:
                raise KeyError(f"the checkpoint has no tensor {fqn!r}")
            want = ChunkStorageMetadata(offsets=torch.Size(off), sizes=dest.size())
            items += create_read_items_for_chunk_list(fqn, md, [want])
        return LoadPlan(items)

    def lookup_tensor(self, index) -> torch.Tensor:
        return self.chunks[(index.fqn, tuple(index.offset))]


def read_chunks(ckpt_dir: str, chunks: list[tuple[str, tuple[int, ...], torch.Tensor]]) -> None:
    """Fill each destination tensor with its chunk of a torch_dist checkpoint, reading nothing else."""
    import torch.distributed.checkpoint as dcp

    dcp.load({}, storage_reader=dcp.FileSystemReader(str(ckpt_dir)), planner=_ChunkLoadPlanner(chunks))
