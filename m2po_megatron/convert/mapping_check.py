"""Checkpoint conversion's HF <-> Megatron mapping at a model's real size, for one TP x PP layout, in meta tensors.

    python -m m2po_megatron.convert.mapping_check CONFIG_OR_DIR [...] [--tp 1,2,4,8] [--pp 1,2,4]

`check_mapping(spec, tp, pp)` follows a conversion's own code paths without reading or writing a byte:
- HF -> Megatron (`convert.checkpoint.hf_to_megatron` at this layout): on every (pipeline stage, TP rank) of a
  fake process group of TP x PP ranks, the model `checkpoint._build_meta` builds (the conversion rank's own,
  on the meta device), each parameter's rule (`models.weights.rule_for`) and the shape `to_megatron_shard` makes
  from the HF shapes (what `streaming.MaterializingTorchDistSave` demands), then megatron's own
  `sharded_state_dict()` (factories applied: the swiglu halves): where each stored chunk comes from in which
  parameter and where it goes in the checkpoint's global tensors.
- Element bookkeeping: every HF tensor is an index vector along the dimension its rule moves (rows; columns for
  the row-parallel split; the one dimension of a 1-D tensor), the HF tensors of one parameter (q, k, v; gate,
  up) in separate value ranges. Each TP rank's `to_megatron_shard` of them is written where its chunk goes: each
  position of every global tensor must be written by exactly one main replica (no overlap, no gap), other
  replicas (TP copies of norms, a tied output layer) must hold the same elements, and every key and global shape
  must be those of the TP1 x PP1 model (which Megatron -> HF reads the checkpoint into).
- Megatron -> HF (`convert.checkpoint.megatron_to_hf`): `_iter_hf_tensors_from_checkpoint` runs on the TP1 x PP1
  meta model with `streaming.read_chunks` answered from the bookkeeping above; it must yield every HF name once,
  in `hf_write_plan`'s order, with its HF shape, and `to_hf` of what it read must give back every HF tensor's
  elements in place.
- The weight sync's inverse (`convert.export.iter_hf_tensors`: all TP ranks' shards, gathered in rank order, through
  `to_hf`): every HF tensor's elements in place.

A layout the model cannot be split into is refused before anything runs, by `models.layout.validate_layout`
(the same call as conversion's and the builder's), with a message naming the field and asking for a divisor.
The other real-size check of the mapping (the training model on fake tensors, the export's names and shapes) is
`convert.layout_check`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Iterator, Optional

import torch

from m2po_megatron.models import weights
from m2po_megatron.models.hf_config import HFModelSpec, read_hf_config

_APART = 1 << 40  # offset between the index values of the HF tensors of one parameter
TPS, PPS = (1, 2, 4, 8), (1, 2, 4)


def _axis(rule: weights.Rule, ndim: int) -> int:
    """The dimension of an HF tensor / Megatron parameter that the rule moves elements along."""
    return 1 if rule.kind == "row" and ndim == 2 else 0


def _index(shape: tuple[int, ...], axis: int, k: int) -> torch.Tensor:
    """A stand-in for an HF tensor: its positions along `axis`, shaped to broadcast over the other dimension."""
    v = torch.arange(shape[axis]) + k * _APART
    if len(shape) == 1:
        return v
    return v.view(1, -1) if axis == 1 else v.view(-1, 1)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _slot(global_shape, slot: tuple) -> int:
    """Row of a stored tensor's layer slot (offsets along its prepended axes) in the bookkeeping."""
    i = 0
    for d, o in zip(global_shape, slot):
        i = i * d + o
    return i


def _flat(t: torch.Tensor, axis: int) -> torch.Tensor:
    return t.reshape(-1) if t.dim() == 1 else (t.reshape(-1) if t.shape[1 - axis] == 1 else t.select(1 - axis, 0))


def valid_layouts(spec: HFModelSpec, tps=TPS, pps=PPS) -> tuple[list[tuple[int, int]], dict[tuple[int, int], str]]:
    """([(tp, pp) the model can be split into], {(tp, pp): validate_layout's message} for the others)."""
    from m2po_megatron.models.layout import validate_layout

    ok, bad = [], {}
    for tp in tps:
        for pp in pps:
            try:
                validate_layout(spec, tp, pp)
                ok.append((tp, pp))
            except ValueError as e:
                bad[(tp, pp)] = str(e)
    return ok, bad


@contextlib.contextmanager
def fake_rank(tp: int, pp: int, pp_rank: int, tp_rank: int) -> Iterator[None]:
    """Megatron's parallel state as one rank of a TP x PP world (fake process group; rank = stage x TP + TP
    rank, megatron's order with DP = CP = 1); everything undone on exit."""
    from megatron.core import parallel_state as ps

    from m2po_megatron.actor import cpu_compat
    from m2po_megatron.infra.fake_world import close_fake_world, init_fake_world

    cpu_compat.activate()  # as a conversion rank on CPU does (a MoE layer's dispatcher makes a CUDA stream)
    rank, world = pp_rank * tp + tp_rank, tp * pp
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    hook = sys.excepthook  # every init_process_group wraps it once more (a rank prefix): hundreds of ranks deep
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
    try:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        init_fake_world(rank, world)
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        assert ps.get_tensor_model_parallel_rank() == tp_rank and ps.get_pipeline_model_parallel_rank() == pp_rank
        yield
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        close_fake_world()
        sys.excepthook = hook
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _meta_model(spec: HFModelSpec):
    from m2po_megatron.convert.checkpoint import _build_meta

    return _build_meta(spec, torch.bfloat16)


def _chunks(model) -> list:
    """megatron's ShardedTensors of the model's sharded_state_dict, factories applied (what the save writes)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sd = model.sharded_state_dict()
    apply_factories(sd)
    return [v for v in nested_values(sd) if isinstance(v, ShardedTensor)]


def _place(sh, p: torch.Tensor, axis: int) -> tuple[Optional[str], int, int, tuple, int]:
    """Where a stored chunk (a view of parameter p) sits: (problem or None, its first position along `axis` in
    p, its length, its layer slot (the prepended axes' offsets), its first position along `axis` in the stored
    tensor)."""
    v, pre = sh.data, sh.prepend_axis_num
    off = v.storage_offset() - p.storage_offset()
    gaxis = pre + axis
    others = [d for d in range(p.dim()) if d != axis]
    if (tuple(sh.local_shape) != tuple(v.shape) or len(sh.global_shape) != pre + p.dim()
            or any(v.shape[d] != p.shape[d] or sh.global_shape[pre + d] != p.shape[d]
                   or sh.global_offset[pre + d] for d in others)):
        return (f"{sh.key}: a chunk {tuple(v.shape)} at {tuple(sh.global_offset)} of {tuple(sh.global_shape)} is not "
                f"whole rows of the parameter {tuple(p.shape)} along dim {axis}", 0, 0, (), 0)
    if off % p.stride(axis) or (axis == 1 and off):
        return f"{sh.key}: a chunk starts inside a row of its parameter", 0, 0, (), 0
    return None, off // p.stride(axis), v.shape[axis], tuple(sh.global_offset[:pre]), sh.global_offset[gaxis]


class _Read:
    """What Megatron -> HF conversion reads, per parameter of the TP1 x PP1 model: [(key, layer slot, first
    position in the stored tensor, first position in the parameter, length)], its rule and layer, and the
    (hf name, shape) it yields. Independent of the layout the checkpoint was written at: computed once per
    config."""

    def __init__(self, spec: HFModelSpec):
        from m2po_megatron.convert import checkpoint, streaming
        from m2po_megatron.models.loading import global_named_parameters

        self.problems: list[str] = []
        with fake_rank(1, 1, 0, 0):
            model = _meta_model(spec)
            self.global_shapes = {sh.key: tuple(sh.global_shape) for sh in _chunks(model)}
            params = [(n, p) for n, p in global_named_parameters(model)
                      if not (n == "output_layer.weight" and spec.tie_word_embeddings)]
            calls: list[list] = []
            real = streaming.read_chunks
            streaming.read_chunks = lambda _dir, chunks: calls.append(chunks)
            try:
                with torch.device("meta"):  # the reader's destination tensors take no memory
                    self.yielded = [(n, tuple(t.shape)) for n, t in
                                    checkpoint._iter_hf_tensors_from_checkpoint(spec, model, "<no files>")]
            finally:
                streaming.read_chunks = real
            try:
                plan = [n for n, _, _ in checkpoint.hf_write_plan(spec, model, torch.bfloat16)]
            except (AssertionError, KeyError) as e:
                plan = None
                self.problems.append(f"convert.checkpoint.hf_write_plan: {e}")
        if plan is not None and [n for n, _ in self.yielded] != plan:
            self.problems.append("Megatron -> HF yields its tensors in another order than hf_write_plan's")
        if len(calls) != len(params):
            self.problems.append(f"Megatron -> HF read {len(calls)} parameters, the model has {len(params)}")
        self.params = []
        for (name, p), chunks in zip(params, calls):
            rule, layer = weights.rule_for(spec, name)
            axis = _axis(rule, p.dim())
            reads = []
            for key, goff, view in chunks:
                pre = view.dim() - p.dim()
                vshape = tuple(view.shape[pre:])
                off = view.storage_offset()
                others = [d for d in range(p.dim()) if d != axis]
                if any(vshape[d] != p.shape[d] or goff[pre + d] for d in others) or off % p.stride(axis) \
                        or (axis == 1 and off):
                    self.problems.append(f"{name}: Megatron -> HF reads {key} at {goff} into {vshape}, not whole "
                                         f"rows along dim {axis}")
                    continue
                reads.append((key, tuple(goff[:pre]), goff[pre + axis], off // p.stride(axis), vshape[axis]))
            self.params.append((name, tuple(p.shape), rule, layer, axis, reads))


_READS: dict[str, _Read] = {}  # by repr(spec) (its rope_scaling is a dict)


def _read_plan(spec: HFModelSpec) -> _Read:
    key = repr(spec)
    if key not in _READS:
        _READS[key] = _Read(spec)
    return _READS[key]


def check_mapping(spec, tp: int, pp: int) -> list[str]:
    """Problems of converting `spec` at TP x PP and back (module docstring); [] when none. Raises ValueError
    (validate_layout's message) for a layout the model cannot be split into."""
    from m2po_megatron.models.layout import validate_layout

    spec = spec if isinstance(spec, HFModelSpec) else read_hf_config(spec)
    validate_layout(spec, tp, pp)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # vectors of at most a vocabulary's length: threads only contend
    try:
        return _check(spec, tp, pp)
    finally:
        torch.set_num_threads(threads)


def _check(spec: HFModelSpec, tp: int, pp: int) -> list[str]:
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    from m2po_megatron.convert.streaming import storage_key
    from m2po_megatron.models.loading import global_named_parameters

    read = _read_plan(spec)
    problems = list(read.problems)
    hf_shapes = weights.expected_hf_shapes(spec)
    # key -> (the positions each stored element holds, how many main replicas wrote it): [layer slot, moved axis]
    stored: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    shapes: dict[str, tuple] = {}
    replicas: list[tuple] = []
    idx_cache: dict[str, tuple] = {}  # per rule: the same for every layer
    shard_shapes: dict[tuple, tuple] = {}

    def indices(rule, names, axis):
        if rule.megatron not in idx_cache:
            hf = [_index(hf_shapes[n], axis, k) for k, n in enumerate(names)]
            shards = [weights.to_megatron_shard(spec, rule, hf, r, tp) for r in range(tp)]
            idx_cache[rule.megatron] = (hf, shards, [_flat(t, axis) for t in shards])
            # the weight sync's inverse: every rank's shard, gathered in rank order, through to_hf
            gathered = shards if rule.kind != "replicated" else shards[:1]
            back = weights.to_hf(spec, rule, gathered, 0)  # (the layer only names the tensors)
            if len(back) != len(hf) or not all(t.shape == h.shape and torch.equal(t, h)
                                               for (_, t), h in zip(back, hf)):
                problems.append(f"{rule.megatron}: to_hf of the {tp} TP ranks' shards does not give back the HF "
                                f"tensors (the weight sync's export)")
        return idx_cache[rule.megatron]

    for stage in range(pp):
        for r in range(tp):
            with fake_rank(tp, pp, stage, r):
                model = _meta_model(spec)
                params = {}
                for name, p in global_named_parameters(model):
                    try:
                        rule, layer = weights.rule_for(spec, name)
                    except KeyError as e:
                        problems.append(str(e))
                        continue
                    names = weights.hf_names(rule, layer)
                    missing = [n for n in names if n not in hf_shapes]
                    if missing:
                        problems.append(f"{name}: maps to {missing}, which the HF checkpoint does not have")
                        continue
                    if (rule.megatron, r) not in shard_shapes:  # the same for every layer
                        metas = [torch.empty(hf_shapes[n], device="meta") for n in names]
                        made = weights.to_megatron_shard(spec, rule, metas, r, tp)
                        shard_shapes[rule.megatron, r] = tuple(made.shape)
                    want = shard_shapes[rule.megatron, r]
                    if want != tuple(p.shape):
                        problems.append(f"{name} (TP {r}/{tp}, stage {stage}/{pp}): Megatron's shape "
                                        f"{tuple(p.shape)}, the mapping makes {want} from "
                                        f"{[hf_shapes[n] for n in names]}")
                        continue
                    axis = _axis(rule, p.dim())
                    params[storage_key(p)] = (name, p, axis, indices(rule, names, axis)[2][r])
                for sh in _chunks(model):
                    if storage_key(sh.data) not in params:
                        problems.append(f"{sh.key}: stored, but not a view of a mapped parameter")
                        continue
                    name, p, axis, vec = params[storage_key(sh.data)]
                    err, start, n, slot, gpos = _place(sh, p, axis)
                    if err:
                        problems.append(err)
                        continue
                    gshape = tuple(sh.global_shape)
                    if shapes.setdefault(sh.key, gshape) != gshape:
                        problems.append(f"{sh.key}: global shape {gshape} on one rank, {shapes[sh.key]} on another")
                        continue
                    part = vec[start:start + n]
                    pre = sh.prepend_axis_num
                    if gpos + n > gshape[pre + axis]:
                        problems.append(f"{sh.key}: a chunk of {name} runs past the stored tensor's end")
                        continue
                    if not is_main_replica(sh.replica_id):
                        replicas.append((sh.key, slot, gpos, part, name))
                        continue
                    if sh.key not in stored:
                        slots = _numel(gshape[:pre])
                        stored[sh.key] = (torch.full((slots, gshape[pre + axis]), -1, dtype=torch.long),
                                          torch.zeros((slots, gshape[pre + axis]), dtype=torch.int16))
                    values, writes = stored[sh.key]
                    i = _slot(gshape, slot)
                    values[i, gpos:gpos + n] = part
                    writes[i, gpos:gpos + n] += 1
    if shapes != read.global_shapes:
        diff = sorted(k for k in set(shapes) | set(read.global_shapes) if shapes.get(k) != read.global_shapes.get(k))
        problems.append(f"the checkpoint written at TP{tp} x PP{pp} differs from the TP1 x PP1 model's in "
                        f"{[(k, shapes.get(k), read.global_shapes.get(k)) for k in diff[:4]]}")
    for key, (values, writes) in stored.items():
        for what, bad in (("by no rank", writes == 0), ("by more than one rank", writes > 1)):
            if bad.any():
                slots = bad.any(1).nonzero().view(-1).tolist()
                problems.append(f"{key}: {int(bad.sum())} of its {writes.numel()} positions (along the split "
                                f"dimension, in {len(slots)} layer slots from {slots[0]}) are written {what}")
    for key, slot, gpos, part, name in replicas:
        if key not in stored or not torch.equal(stored[key][0][_slot(shapes[key], slot), gpos:gpos + len(part)],
                                                part):
            problems.append(f"{key}{list(slot)}: {name}'s replica holds other elements than the stored main copy")
    # Megatron -> HF: each TP1 parameter read from the stored tensors, through to_hf
    for name, pshape, rule, layer, axis, reads in read.params:
        pieces, at = [], 0
        for key, slot, gpos, start, n in sorted(reads, key=lambda x: x[3]):
            if key not in stored:
                problems.append(f"{name}: Megatron -> HF reads {key}, which no rank wrote")
                break
            if start != at:
                problems.append(f"{name}: Megatron -> HF reads positions {at}..{start} of it from nowhere or twice")
                break
            pieces.append(stored[key][0][_slot(shapes[key], slot), gpos:gpos + n])
            at = start + n
        else:
            if at != pshape[axis]:
                problems.append(f"{name}: Megatron -> HF leaves positions {at}..{pshape[axis]} of it unread")
        if at != pshape[axis]:
            continue
        vec = torch.cat(pieces)
        names = weights.hf_names(rule, layer)
        shape = [1] * len(pshape)
        shape[axis] = -1
        back = weights.to_hf(spec, rule, [vec.view(shape)], layer)
        if [n for n, _ in back] != names:
            problems.append(f"{name}: to_hf gives {[n for n, _ in back]}, not {names}")
            continue
        for k, (n, t) in enumerate(back):
            want = _flat(_index(hf_shapes[n], axis, k), axis)
            if not torch.equal(_flat(t, axis), want):
                problems.append(f"{n}: HF -> Megatron (TP{tp} x PP{pp}) -> HF puts other elements in its place")
    counts: dict[str, int] = {}
    for n, s in read.yielded:
        counts[n] = counts.get(n, 0) + 1
        if n in hf_shapes and tuple(hf_shapes[n]) != s:
            problems.append(f"Megatron -> HF gives {n} the shape {s}, HF has {tuple(hf_shapes[n])}")
    if set(counts) != set(hf_shapes) or any(c != 1 for c in counts.values()):
        problems.append(f"Megatron -> HF yields {sorted(n for n, c in counts.items() if c > 1)[:4]} more than once,"
                        f" misses {sorted(set(hf_shapes) - set(counts))[:4]}, adds "
                        f"{sorted(set(counts) - set(hf_shapes))[:4]}")
    return problems


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+", help="HF config.json files or model directories")
    ap.add_argument("--tp", default="1,2,4,8", help="tensor parallel sizes (default 1,2,4,8)")
    ap.add_argument("--pp", default="1,2,4", help="pipeline parallel sizes (default 1,2,4)")
    a = ap.parse_args(argv)
    tps, pps = [int(x) for x in a.tp.split(",")], [int(x) for x in a.pp.split(",")]
    bad_any = False
    for c in a.configs:
        spec = read_hf_config(c)
        ok, bad = valid_layouts(spec, tps, pps)
        for tp, pp in ok:
            problems = check_mapping(spec, tp, pp)
            bad_any |= bool(problems)
            print(json.dumps({"config": c, "tp": tp, "pp": pp, "problems": problems}))
        for (tp, pp), msg in bad.items():
            print(json.dumps({"config": c, "tp": tp, "pp": pp, "rejected": msg}))
    return 1 if bad_any else 0


if __name__ == "__main__":
    sys.exit(main())
