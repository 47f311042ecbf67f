"""Model configs at one rollout TP, in a process of their own (sglang's parallel state is per process): sglang
0.5.23's model class built on the meta device at rank 0 of TP ranks, then its own `load_weights` (what
update_weights_from_distributed calls with the received tensors) fed the names and full shapes the trainer sends
(models.weights.expected_hf_shapes: convert.export.iter_hf_tensors yields exactly these at every trainer
layout, checked in tests/convert/test_layout_check.py). Every parameter's weight_loader is wrapped to see
which sent names reach which parameters; the loaders' own shape checks run on the meta tensors.

    python tests/contract/weight_names_worker.py TP CONFIG_JSON... [--drop NAME] [--reshape NAME]

prints one JSON line per config: params, loaded, unloaded (parameters no name reached), unconsumed (names that
reached no parameter), incomplete (stacked parameters, qkv_proj and gate_up_proj, missing a shard), misshaped
(a sent tensor whose whole shape is not the layer's), error. --drop / --reshape alter what is sent, for the
tests that the check can fail."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODULES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}


def _parallel(tp: int) -> None:
    """sglang's distributed environment and model-parallel groups at rank 0 of `tp` ranks. TP 1: sglang's own
    test helper (gloo). TP > 1: torch's fake process group (no other ranks exist), with every group sglang
    builds on it, gloo included."""
    import torch.distributed as dist

    if tp == 1:
        from sglang.test.layer_ut_utils import init_single_process_dist

        from m2po_megatron.infra.net import free_port

        init_single_process_dist(master_port=free_port("127.0.0.1"))
        return
    from sglang.srt.distributed import parallel_state as sps
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.test.test_utils import publish_build_topology

    from m2po_megatron.infra.fake_world import init_fake_world

    # no GPU and no other ranks here: sglang's groups are built without their NCCL / custom all-reduce
    # communicators and shared-memory broadcaster (which waits for the other ranks); loading weights never
    # communicates
    build = sps.init_model_parallel_group

    def without_device_comms(*args, **kwargs):
        kwargs.update(use_pynccl=False, use_custom_allreduce=False, use_mscclpp=False,
                      use_torch_symm_mem_allreduce=False, use_message_queue_broadcaster=False)
        return build(*args, **kwargs)

    sps.init_model_parallel_group = without_device_comms
    init_fake_world(0, tp)
    os.environ.update(RANK="0", WORLD_SIZE=str(tp), LOCAL_RANK="0")
    init_distributed_environment(world_size=tp, rank=0, local_rank=0, backend="fake")
    publish_build_topology(tp_size=tp, ep_size=1, pp_size=1)
    initialize_model_parallel(backend="fake")
    assert dist.get_world_size() == tp


def check(config: str, tp: int, drop=(), reshape=()) -> dict:
    """The check of one config at rank 0 of `tp` ranks (parallel state already set up); see the docstring."""
    import torch
    from sglang.srt.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from sglang.srt.model_loader.weight_utils import default_weight_loader
    from transformers import AutoConfig

    from m2po_megatron.models.hf_config import read_hf_config
    from m2po_megatron.models.weights import expected_hf_shapes

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
        """The whole (unsharded) tensor sglang's layer expects, from the layer's own sizes: its loaders narrow a
        larger tensor to their slice without complaint, so the size is checked here."""
        owner, leaf = pname.rsplit(".", 1)
        mod = modules[owner]
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
        else:
            continue
        for pn, _ in mod.named_parameters(recurse=False):
            stacked[f"{mname}.{pn}"] = want

    shapes = expected_hf_shapes(read_hf_config(config))
    for n in drop:
        shapes.pop(n)
    for n in reshape:
        shapes[n] = (shapes[n][0] + 8, *shapes[n][1:])

    def sent():
        for n, s in shapes.items():
            current["name"] = n
            yield n, torch.empty(s, dtype=torch.bfloat16, device="meta")

    out: dict = {"config": Path(config).parent.name, "arch": arch, "tp": tp, "params": len(params),
                 "sent": len(shapes)}
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
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("tp", type=int)
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--drop", action="append", default=[])
    ap.add_argument("--reshape", action="append", default=[])
    a = ap.parse_args()
    # sglang's RotaryEmbedding imports a fallback rope kernel from vllm on a machine that is neither CUDA nor its
    # CPU engine; loading weights never calls it, and this environment has no vllm
    stub = types.ModuleType("vllm._custom_ops")
    stub.rotary_embedding = None
    sys.modules.setdefault("vllm", types.ModuleType("vllm")).__dict__["_custom_ops"] = stub
    sys.modules.setdefault("vllm._custom_ops", stub)
    _parallel(a.tp)
    for c in a.configs:
        print(json.dumps(check(c, a.tp, a.drop, a.reshape)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
