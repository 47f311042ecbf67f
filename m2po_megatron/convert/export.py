"""Export of a live, sharded Megatron model as HF-named full tensors, in buckets for the rollout weight sync
(and whole, for tests). Conversion of a saved checkpoint reads it directly (checkpoint.py).

Who gets tensors: on each pipeline stage, the *source rank* (tensor-parallel rank 0, data-parallel rank 0,
context-parallel rank 0) yields that stage's tensors; every other rank yields nothing. All tensor-parallel ranks
of a data-parallel-rank-0 replica must iterate to the end, because each parameter is all-gathered over the TP
group. With mixture of experts, so must every rank of expert-data-parallel rank 0: each expert parameter is
all-gathered over the expert-tensor-parallel group and then over the expert-parallel group (which spans
data-parallel replicas). `exports_weights()` says whether a rank iterates; the others return at once.

Order: deterministic: pipeline stage's chunks in order, parameters in module order (embedding, layers in order,
final norm, output layer), HF names within a parameter in table order (q, k, v; gate, up); the experts of an
expert-parallel gather in EP-rank order (local expert j of every EP rank, then j + 1). With tied embeddings
the last stage's output_layer copy is skipped (HF has no lm_head.weight)."""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from m2po_megatron.models.hf_config import HFModelSpec, read_hf_config
from m2po_megatron.models.loading import global_named_parameters
from m2po_megatron.models.weights import EXPERT, expert_rules, rule_for, to_hf


def _spec(hf_config: Any) -> HFModelSpec:
    return hf_config if isinstance(hf_config, HFModelSpec) else read_hf_config(hf_config)


def is_source_rank() -> bool:
    """This rank yields its pipeline stage's tensors (TP, DP and CP rank 0)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return True
    return (ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0)


def exports_weights(hf_config: Any) -> bool:
    """This rank must run iter_hf_tensors to the end (it takes part in its gathers); see module docstring."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return True
    dense = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    return dense or (_spec(hf_config).is_moe and ps.get_expert_data_parallel_rank() == 0)


def _gather(data: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    import torch.distributed as dist

    if size == 1:
        return [data]
    parts = [torch.empty_like(data) for _ in range(size)]
    dist.all_gather(parts, data.contiguous(), group=group)
    return parts


def _expert_tensors(spec: HFModelSpec, name: str, data: torch.Tensor, layer: int, source: bool):
    """All EP ranks' copies of this local expert parameter, ETP shards joined: (hf_name, tensor) on the source."""
    from megatron.core import parallel_state as ps

    init = ps.model_parallel_is_initialized()
    etp = ps.get_expert_tensor_parallel_world_size() if init else 1
    ep = ps.get_expert_model_parallel_world_size() if init else 1
    shards = _gather(data, etp, ps.get_expert_tensor_parallel_group() if etp > 1 else None)
    per_ep = [_gather(s, ep, ps.get_expert_model_parallel_group() if ep > 1 else None) for s in shards]
    if not source:
        return
    x = EXPERT.match(name.split(".", 3)[3])
    fc = x.group(2) or x.group(3)
    e = int(x.group(1) if x.group(1) is not None else x.group(4))
    local = spec.num_experts // ep
    for r in range(ep):
        rule = expert_rules(r * local + e % local)[0 if fc == "linear_fc1" else 1]
        yield from to_hf(spec, rule, [per_ep[k][r] for k in range(etp)], layer)


@torch.no_grad()
def iter_hf_tensors(model_chunks: Any, hf_config: Any, dtype: torch.dtype | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, full tensor) for this pipeline stage, on its source rank (see module docstring)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    spec = _spec(hf_config)
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    init = ps.model_parallel_is_initialized()
    if not exports_weights(spec):
        return
    dense = not init or (ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0)
    source = is_source_rank()
    tp = ps.get_tensor_model_parallel_world_size() if init else 1
    tp_rank = ps.get_tensor_model_parallel_rank() if init else 0
    group = ps.get_tensor_model_parallel_group() if init and tp > 1 else None
    for chunk in chunks:
        for name, p in global_named_parameters(chunk):
            if name == "output_layer.weight" and spec.tie_word_embeddings:
                continue
            rule, layer = rule_for(spec, name)
            data = p.detach()
            if rule.expert:
                for hf_name, t in _expert_tensors(spec, name, data, layer, source):
                    yield hf_name, (t.to(dtype) if dtype is not None else t).contiguous()
                continue
            if not dense:
                continue
            if tp > 1 and rule.kind != "replicated":
                parts = [torch.empty_like(data) for _ in range(tp)]
                dist.all_gather(parts, data.contiguous(), group=group)
            else:
                parts = [data]
            if tp_rank != 0:
                continue
            for hf_name, t in to_hf(spec, rule, parts, layer):
                t = t.to(dtype) if dtype is not None else t
                yield hf_name, t.contiguous()


@torch.no_grad()
def gather_hf_state_dict(model_chunks: Any, hf_config: Any) -> dict[str, torch.Tensor]:
    """The full model under HF names on every rank (fp32 CPU tensors): `iter_hf_tensors` on every rank, then
    the source ranks' tensors shared with all. Holds everything at once: for tests and small models; weight
    sync streams with `iter_hf_weight_buckets` instead."""
    import torch.distributed as dist

    local = {k: v.float().cpu().clone() for k, v in iter_hf_tensors(model_chunks, hf_config)}
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, v in part.items():
            out.setdefault(k, v)
    return out


def iter_hf_weight_buckets(model_chunks: Any, hf_config: Any, bucket_mb: float = 512, dtype: torch.dtype | None = None
                           ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Lists of (hf_name, full tensor) of at most `bucket_mb` MiB each (a single larger tensor gets a bucket of
    its own), in the deterministic order of `iter_hf_tensors`. Yields only on each pipeline stage's source rank;
    every TP rank of data-parallel replica 0 must exhaust the iterator (it all-gathers)."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    yield from hf_buckets(iter_hf_tensors(model_chunks, hf_config, dtype), int(bucket_mb * 1024 * 1024))


def hf_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 512 << 20):
    """Group (name, tensor) pairs into lists of at most ~bucket_bytes (a tensor larger than that goes alone)."""
    bucket, size = [], 0
    for name, t in named_tensors:
        b = t.numel() * t.element_size()
        if bucket and size + b > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += b
    if bucket:
        yield bucket
