"""HF <-> Megatron mapping checked at a model's real size, for one TP x PP layout, without its memory.

    python -m m2po_megatron.convert.layout_check CONFIG_OR_DIR [...] [--tp 1,2,4,8] [--pp 1,2,4]

For each pipeline stage the real megatron-core GPTModel of the config is built on fake tensors (the rehearsal's
fake world: a fake process group of TP x PP ranks, rank = stage x TP), and the project's own mapping code runs
on it:
- every Megatron parameter has a rule (models.weights.rule_for on global_named_parameters' names), and its
  shape is what to_megatron_shard makes of the HF tensors' shapes, on every TP rank (meta tensors);
- every element of every HF tensor lands in exactly one TP rank's slice of exactly one parameter (index
  tensors: row numbers through the row-wise rules, column numbers through the column split), and to_hf of all
  TP ranks' slices gives back the HF names and the original indices; a tied embedding's output-layer copy on
  the last stage holds the same slices as the embedding;
- the export iterator the weight sync runs (convert.export.iter_hf_tensors) yields, over all stages, every HF
  name once with its HF shape; at TP1 x PP1, the layout Megatron -> HF conversion reads a checkpoint into,
  convert.checkpoint.hf_write_plan lists every HF name with its shape.
A layout the model cannot be split into (e.g. more TP ranks than KV heads) is reported with
models.layout.validate_layout's message, which names the field and the fix.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

import torch

from m2po_megatron.models.hf_config import HFModelSpec, read_hf_config
from m2po_megatron.models.weights import expected_hf_shapes, hf_names, rule_for, to_hf, to_megatron_shard


_APART = 1 << 40  # offset between the index values of the HF tensors of one parameter


def _index(shape: tuple[int, ...], kind: str) -> torch.Tensor:
    """A stand-in of an HF tensor that carries, per element of the dimension the rule moves, its position:
    rows for row-wise rules, columns for 'row' (split along dim 1), every element for 1-D tensors."""
    if len(shape) == 1:
        return torch.arange(shape[0])
    if kind == "row":
        return torch.arange(shape[1]).view(1, -1)
    return torch.arange(shape[0]).view(-1, 1)


def check_layout(hf_config, tp: int, pp: int) -> dict:
    """{"tp", "pp", "valid", "problems": [...], "stages": n, "params": {stage: count}} for one layout."""
    from m2po_megatron.models.layout import validate_layout

    spec = hf_config if isinstance(hf_config, HFModelSpec) else read_hf_config(hf_config)
    out: dict = {"tp": tp, "pp": pp, "valid": True, "problems": []}
    try:
        validate_layout(spec, tp, pp)
    except ValueError as e:
        out.update(valid=False, rejected=str(e))
        return out
    hf_shapes = expected_hf_shapes(spec)
    seen: dict[str, tuple[int, list]] = {}
    exported: dict[str, tuple] = {}
    params = {}
    for stage in range(pp):
        chunks = _build_stage(spec, tp, pp, stage)
        params[stage] = sum(p.numel() for c in chunks for p in c.parameters())
        if tp == pp == 1:  # Megatron -> HF conversion reads its checkpoint into this layout: its write plan
            from m2po_megatron.convert.checkpoint import hf_write_plan

            try:
                plan = hf_write_plan(spec, chunks[0], torch.bfloat16)
                if {n: s for n, s, _ in plan} != {n: tuple(s) for n, s in hf_shapes.items()}:
                    out["problems"].append("convert.checkpoint.hf_write_plan's names or shapes differ from HF's")
            except (AssertionError, KeyError) as e:
                out["problems"].append(f"convert.checkpoint.hf_write_plan: {e}")
        out["problems"] += _coverage_problems(spec, chunks, tp, hf_shapes, seen)
        for n, shape in _exported(spec, chunks):
            if n in exported:
                out["problems"].append(f"the export yields {n} twice (stages)")
            exported[n] = shape
    for n, shape in hf_shapes.items():
        if n not in seen:
            out["problems"].append(f"{n}: in no Megatron parameter")
            continue
        size, parts = seen[n]
        got = torch.sort(torch.cat(parts)).values
        if not torch.equal(got, torch.arange(size)):
            out["problems"].append(f"{n} {tuple(shape)}: its {size} rows/columns are not each in exactly one "
                                   f"slice ({got.numel()} held)")
    if set(exported) != set(hf_shapes):
        out["problems"].append(f"the export misses {sorted(set(hf_shapes) - set(exported))[:5]} and adds "
                               f"{sorted(set(exported) - set(hf_shapes))[:5]}")
    for n, shape in exported.items():
        if n in hf_shapes and tuple(shape) != tuple(hf_shapes[n]):
            out["problems"].append(f"the export gives {n} the shape {tuple(shape)}, HF has {hf_shapes[n]}")
    out["stages"] = pp
    out["params"] = params
    return out


def _coverage_problems(spec: HFModelSpec, chunks: list, tp: int, hf_shapes: dict, seen: dict) -> list[str]:
    """Checks of one stage's parameters (module docstring); fills seen[hf_name] = (size of the dimension the rule
    moves, [the positions each TP slice holds])."""
    from m2po_megatron.models.loading import global_named_parameters

    problems = []
    for chunk in chunks:
        for name, p in global_named_parameters(chunk):
            try:
                rule, layer = rule_for(spec, name)
            except KeyError as e:
                problems.append(str(e))
                continue
            names = hf_names(rule, layer)
            missing = [n for n in names if n not in hf_shapes]
            if missing:
                problems.append(f"{name}: maps to {missing}, which the HF checkpoint does not have")
                continue
            metas = [torch.empty(hf_shapes[n], device="meta") for n in names]
            # each HF tensor of the parameter gets its own range of values (q, k and v; gate and up), so a slice
            # holding one tensor's elements where another's belong is seen
            idx = [_index(hf_shapes[n], rule.kind) + k * _APART for k, n in enumerate(names)]
            ranks = tp if rule.kind != "replicated" else 1
            slices = []
            for r in range(ranks):
                want = tuple(to_megatron_shard(spec, rule, metas, r, tp).shape)
                have = tuple(p.shape)
                if have != want:
                    problems.append(f"{name} (TP rank {r}): Megatron's shape {have}, the mapping makes {want} "
                                    f"from {[hf_shapes[n] for n in names]}")
                slices.append(to_megatron_shard(spec, rule, idx, r, tp))
            back = to_hf(spec, rule, slices, layer)
            if [n for n, _ in back] != names:
                problems.append(f"{name}: to_hf gives {[n for n, _ in back]}, not {names}")
                continue
            if not all(torch.equal(t, i) for (_, t), i in zip(back, idx)):
                problems.append(f"{name}: to_hf of the TP slices does not give back the HF tensors' elements")
            if name == "output_layer.weight" and spec.tie_word_embeddings:
                continue  # the last stage's copy of the embedding, which the export skips
            # which positions of each HF tensor each slice holds: one TP rank's slice at a time through to_hf
            # (the others -1), which also tells apart the HF tensors of one parameter (q/k/v, gate/up)
            sizes = {n: int(i.numel()) for n, i in zip(names, idx)}
            for r in range(ranks):
                only = [torch.full_like(t, -1) if k != r else t for k, t in enumerate(slices)]
                for n, t in to_hf(spec, rule, only, layer):
                    held = t.reshape(-1)
                    held = held[held >= 0] - names.index(n) * _APART
                    if len(held) and not (0 <= int(held.min()) and int(held.max()) < sizes[n]):
                        problems.append(f"{name} (TP rank {r}): {n} gets elements of another HF tensor")
                    seen.setdefault(n, (sizes[n], []))[1].append(held)
    return problems


def _exported(spec, chunks) -> list[tuple[str, tuple]]:
    """(hf name, shape) of what convert.export.iter_hf_tensors yields for this stage (its all-gathers logged
    and answered by the fake world: the shapes are real, the values are not)."""
    from m2po_megatron.convert.export import iter_hf_tensors
    from m2po_megatron.infra.fake_world import CollectiveLog, RehearsalMode, logged_collectives

    with RehearsalMode(), logged_collectives(CollectiveLog()):
        return [(n, tuple(t.shape)) for n, t in iter_hf_tensors(chunks, spec)]


def _build_stage(spec: HFModelSpec, tp: int, pp: int, stage: int) -> list:
    """This stage's model chunks at TP rank 0, built by models.builder on fake tensors in a fake world."""
    import os

    import torch._dynamo
    from megatron.core import parallel_state as ps

    from m2po_megatron.actor import cpu_compat
    from m2po_megatron.infra import device
    from m2po_megatron.models.builder import build_model_chunks, transformer_config_from_hf
    from m2po_megatron.infra.fake_world import RehearsalMode, init_fake_world

    torch._dynamo.config.disable = True
    device.set_rehearsal(True)
    cpu_compat.activate()
    os.environ.update(RANK=str(stage * tp), WORLD_SIZE=str(tp * pp))
    init_fake_world(stage * tp, tp * pp)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    cfg = transformer_config_from_hf(spec, params_dtype=torch.bfloat16, tensor_model_parallel_size=tp,
                                     pipeline_model_parallel_size=pp)
    with RehearsalMode():
        return build_model_chunks(spec, cfg, attention_backend="sdpa")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+", help="HF config.json files or model directories")
    ap.add_argument("--tp", default="1,2,4,8", help="tensor parallel sizes (default 1,2,4,8)")
    ap.add_argument("--pp", default="1,2,4", help="pipeline parallel sizes (default 1,2,4)")
    a = ap.parse_args(argv)
    tps = [int(x) for x in a.tp.split(",")]
    pps = [int(x) for x in a.pp.split(",")]
    results = []
    for c in a.configs:
        spec = read_hf_config(c)
        for tp in tps:
            for pp in pps:
                r = check_layout(spec, tp, pp)
                r["config"] = c
                results.append(r)
    print(json.dumps(results))
    return 0 if all(not r["problems"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
