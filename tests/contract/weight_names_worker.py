"""Weight-sync names at real size, sglang's side: sglang 0.5.23's model class of a bundled config built on the
meta device at one TP rank of a rollout TP, then its own `load_weights` (what update_weights_from_distributed
calls with the received tensors, bucket by bucket) fed meta tensors of the names and whole shapes the trainer
sends (by default models.weights.expected_hf_shapes: convert.export.iter_hf_tensors yields exactly these at every
trainer layout, checked in tests/convert/test_layout_check.py; or a list given in the job). Every parameter's
weight_loader is wrapped to see which sent names reach which parameters and shards; the loaders' own shape
checks run on the meta tensors (they copy nothing).

    python tests/contract/weight_names_worker.py < JOBS

JOBS: one JSON object a line, read as it comes (a job may wait for the one before it to be answered):
{"id", "config": config.json, "tp", "rank" (default 0), "sent": [[name, shape], ...] (default: the expected
names), "drop": [names], "reshape": [names (8 rows more)], "rename": [[old, new]],
"add": [[name, shape]]}. One process serves every
layout: sglang's parallel state is torn down and built again (torch's fake process group, any world size) when
a job's TP or rank differs from the one before. Prints one JSON line per job: params, loaded, unloaded
(parameters no name reached), unconsumed (names that reached no parameter: sglang only logs a warning for
them), incomplete (stacked parameters, qkv_proj and gate_up_proj, missing a shard), misshaped (a sent tensor
whose whole shape is not the layer's: the loaders narrow a larger one to their slice without complaint), error
(a loader's own refusal)."""
from __future__ import annotations

import importlib
import json
import os
import sys
import time
import types
from pathlib import Path

MODULES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama",
           "Qwen3MoeForCausalLM": "qwen3_moe"}
_state = {"layout": None}


def _parallel(tp: int, rank: int) -> None:
    """sglang's distributed environment and model-parallel groups at `rank` of `tp` ranks, on torch's fake
    process group (no other ranks exist), with every group sglang builds on it; the previous layout's groups are
    destroyed first. Loading weights never communicates."""
    import torch.distributed as dist
    from sglang.srt.distributed import parallel_state as sps
    from sglang.srt.runtime_context import get_parallel
    from sglang.test.test_utils import publish_build_topology

    from m2po_megatron.infra.fake_world import close_fake_world, init_fake_world

    if _state["layout"] == (tp, rank):
        return
    if _state["layout"] is not None:
        sps.destroy_model_parallel()
        sps.destroy_distributed_environment()
        close_fake_world()
    if not getattr(sps.init_model_parallel_group, "_m2po_no_device_comms", False):
        # no GPU and no other ranks here: sglang's groups are built without their NCCL / custom all-reduce
        # communicators and shared-memory broadcaster (which waits for the other ranks)
        build = sps.init_model_parallel_group

        def without_device_comms(*args, **kwargs):
            kwargs.update(use_pynccl=False, use_custom_allreduce=False, use_mscclpp=False,
                          use_torch_symm_mem_allreduce=False, use_message_queue_broadcaster=False)
            return build(*args, **kwargs)

        without_device_comms._m2po_no_device_comms = True
        sps.init_model_parallel_group = without_device_comms
    init_fake_world(rank, tp)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(tp), LOCAL_RANK=str(rank))
    sps.init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="fake")
    publish_build_topology(world_rank=rank, tp_size=tp, ep_size=1, pp_size=1)
    sps.initialize_model_parallel(backend="fake")
    assert dist.get_world_size() == tp and (get_parallel().tp_size, get_parallel().tp_rank) == (tp, rank)
    _state["layout"] = (tp, rank)


def _is_fused_moe(mod) -> bool:
    """sglang's FusedMoE layer (Qwen3-MoE's experts, all of a layer's in one parameter pair)."""
    return type(mod).__name__ == "FusedMoE" or any(c.__name__ == "FusedMoE" for c in type(mod).__mro__)


def check(job: dict) -> dict:
    """One job (see the module docstring), its layout set up here."""
    import torch
    from sglang.srt.distributed.utils import get_group_rank_size
    from sglang.srt.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from sglang.srt.model_loader.weight_utils import default_weight_loader
    from transformers import AutoConfig

    from m2po_megatron.models.hf_config import read_hf_config
    from m2po_megatron.models.weights import expected_hf_shapes

    t0 = time.perf_counter()
    config, tp, rank = job["config"], int(job["tp"]), int(job.get("rank", 0))
    _parallel(tp, rank)
    conf = AutoConfig.from_pretrained(str(Path(config).parent))
    arch = conf.architectures[0]
    cls = getattr(importlib.import_module(f"sglang.srt.models.{MODULES[arch]}"), arch)
    with torch.device("meta"):
        model = cls(conf)
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    reached: dict[str, set] = {n: set() for n in params}
    shards: dict[str, set] = {n: set() for n in params}
    misshaped: list[str] = []
    current = {"name": None}

    def full_shape(pname, param, shard):
        """The whole (unsharded) tensor sglang's layer expects, from the layer's own sizes."""
        owner, leaf = pname.rsplit(".", 1)
        mod = modules[owner]
        if _is_fused_moe(mod):  # one expert's gate/up (w1/w3) or down (w2) projection, whole over TP
            ffn = mod.intermediate_size_per_partition * mod.moe_tp_size
            return (mod.hidden_size, ffn) if shard.endswith(":w2") else (ffn, mod.hidden_size)
        if isinstance(mod, QKVParallelLinear):
            rows = {"q": mod.total_num_heads * mod.head_size, "k": mod.total_num_kv_heads * mod.head_size,
                    "v": mod.total_num_kv_heads * mod.v_head_size}[shard]
        elif isinstance(mod, MergedColumnParallelLinear):
            rows = mod.output_sizes[shard]
        elif isinstance(mod, LinearBase):
            rows = mod.output_size
        elif isinstance(mod, VocabParallelEmbedding):
            return (mod.org_vocab_size, mod.embedding_dim)
        else:
            return tuple(param.shape)
        return (rows,) if leaf == "bias" else (rows, mod.input_size)

    def wrap(pname, loader):
        def load(param, tensor, *args, **kwargs):
            if _is_fused_moe(modules[pname.rsplit(".", 1)[0]]):  # (weight_name, shard_id, expert_id)
                names = ("weight_name", "shard_id", "expert_id")
                a = dict(zip(names, args), **{k: v for k, v in kwargs.items() if k in names})
                shard = f"{a['expert_id']}:{a['shard_id']}"
            else:
                shard = args[0] if args else kwargs.get("loaded_shard_id")
            reached[pname].add(current["name"])
            shards[pname].add(shard)
            want = full_shape(pname, param, shard)
            if tuple(tensor.shape) != want:
                misshaped.append(f"{current['name']}: sent {tuple(tensor.shape)}, {pname} takes {want}")
            return loader(param, tensor, *args, **kwargs)
        return load

    for pname, p in params.items():
        p.weight_loader = wrap(pname, getattr(p, "weight_loader", default_weight_loader))
    # the stacked parameters, whose shards come from several sent tensors: sglang's own layer types say which
    stacked = {}
    for mname, mod in modules.items():
        if isinstance(mod, QKVParallelLinear):
            want = {"q", "k", "v"}
        elif isinstance(mod, MergedColumnParallelLinear):
            want = set(range(len(mod.output_sizes)))
        elif _is_fused_moe(mod):  # every expert's gate and up into w13, its down into w2
            ids = range(mod.num_local_experts)
            for pn, _ in mod.named_parameters(recurse=False):
                stacked[f"{mname}.{pn}"] = ({f"{e}:{w}" for e in ids for w in ("w1", "w3")} if "w13" in pn
                                            else {f"{e}:w2" for e in ids})
            continue
        else:
            continue
        for pn, _ in mod.named_parameters(recurse=False):
            stacked[f"{mname}.{pn}"] = want

    if job.get("sent") is not None:
        shapes = {n: tuple(s) for n, s in job["sent"]}
    else:
        shapes = {n: tuple(s) for n, s in expected_hf_shapes(read_hf_config(config)).items()}
    for n in job.get("drop", ()):
        shapes.pop(n)
    for n in job.get("reshape", ()):
        shapes[n] = (shapes[n][0] + 8, *shapes[n][1:])
    for n, shape in job.get("add", ()):
        shapes[n] = tuple(shape)
    for old, new in job.get("rename", ()):
        shapes = {new if n == old else n: s for n, s in shapes.items()}

    def sent():
        for n, s in shapes.items():
            current["name"] = n
            yield n, torch.empty(s, dtype=torch.bfloat16, device="meta")

    out: dict = {"id": job.get("id"), "config": Path(config).parent.name, "arch": arch, "tp": tp, "rank": rank,
                 "params": len(params), "sent": len(shapes)}
    try:
        model.load_weights(sent())
    except Exception as e:  # a loader's own check: reported, the test names it
        out["error"] = f"{type(e).__name__}: {e} (while loading {current['name']})"
    consumed = set().union(*reached.values())
    out["loaded"] = sum(1 for v in reached.values() if v)
    out["unloaded"] = sorted(n for n, v in reached.items() if not v)
    out["unconsumed"] = sorted(set(shapes) - consumed)
    out["misshaped"] = misshaped
    out["incomplete"] = sorted(f"{n}: {sorted(map(str, shards[n]))}" for n, want in stacked.items()
                               if reached[n] and shards[n] != want)
    # the TP rank sglang's layers were built at (their slice of every sharded parameter)
    out["layer_tp"] = sorted({get_group_rank_size(m.tp_group)[::-1] for m in modules.values()
                              if isinstance(m, LinearBase) and not isinstance(m, ReplicatedLinear)})
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def main() -> int:
    import logging

    # sglang's RotaryEmbedding imports a fallback rope kernel from vllm on a machine that is neither CUDA nor its
    # CPU engine; loading weights never calls it, and this environment has no vllm
    stub = types.ModuleType("vllm._custom_ops")
    stub.rotary_embedding = None
    sys.modules.setdefault("vllm", types.ModuleType("vllm")).__dict__["_custom_ops"] = stub
    sys.modules.setdefault("vllm._custom_ops", stub)
    logging.getLogger("sglang").setLevel(logging.ERROR)  # "Parameter ... not found": reported as unconsumed
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(check(json.loads(line))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
