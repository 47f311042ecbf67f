"""HF safetensors <-> Megatron dist checkpoint (torch_dist) conversion, and the logits check behind --verify.

On-disk layout written by hf_to_megatron (OUT):
    OUT/                      the Megatron dist checkpoint itself (metadata.json, .metadata, *.distcp, common.pt)
                              with the state dict {"model": GPTModel.sharded_state_dict()}: the actor's layout,
                              so `load_from=OUT` works and actor checkpoints convert back with megatron_to_hf
    OUT/hf/                   config.json, generation_config.json and tokenizer files of the source model
    OUT/m2po_convert.json     what was converted from, with which dtype and TP/PP
Everything is written to a sibling temp directory first and renamed into place at the end, so an interrupted
conversion never leaves OUT looking complete."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import torch

from m2po_megatron.infra.net import rendezvous_env, serve_rendezvous
from m2po_megatron.models.hf_checkpoint import CheckpointMismatchError, open_hf_source, validate_hf_source
from m2po_megatron.models.hf_config import HFModelSpec, read_hf_config
from m2po_megatron.models.weights import expected_hf_names, expected_hf_shapes, hf_names, rule_for, to_hf

HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
                 "merges.txt", "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
                 "chat_template.jinja", "chat_template.json")
CONVERT_META = "m2po_convert.json"
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def parse_dtype(x) -> torch.dtype | None:
    if x is None or isinstance(x, torch.dtype):
        return x
    if x not in DTYPES:
        raise ValueError(f"unknown dtype {x!r}; use one of {sorted(DTYPES)}")
    return DTYPES[x]


# ---- small helpers -----------------------------------------------------------------------------------------

@contextlib.contextmanager
def _atomic_dir(out_dir: str, overwrite: bool):
    """Yield a temp directory beside out_dir; on success move it to out_dir, on failure delete it."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"output {out_dir} exists; remove it or pass overwrite (--overwrite)")
    tmp = f"{out_dir}.tmp-{os.getpid()}-{int(time.time())}"
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)


def _copy_side_files(src_dir: str | None, dst_dir: str, dtype: torch.dtype | None = None) -> None:
    if not src_dir or not os.path.isdir(src_dir):
        return
    os.makedirs(dst_dir, exist_ok=True)
    for fn in HF_SIDE_FILES:
        p = os.path.join(src_dir, fn)
        if os.path.isfile(p):
            shutil.copy2(p, os.path.join(dst_dir, fn))
    if dtype is not None and os.path.isfile(os.path.join(dst_dir, "config.json")):
        cfg_path = os.path.join(dst_dir, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        name = _DTYPE_NAMES[dtype]
        for key in ("torch_dtype", "dtype"):
            if key in cfg or key == "torch_dtype":
                cfg[key] = name
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)


@contextlib.contextmanager
def _single_process_megatron():
    """A one-rank gloo/NCCL world with Megatron TP1/PP1 for in-process conversion and verification."""
    import torch.distributed as dist

    from m2po_megatron.actor import parallel

    owned = not dist.is_initialized()
    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    if owned:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.pop("MASTER_PORT", None)  # one rank: an in-memory store (parallel.init_distributed)
    try:
        parallel.init_distributed()
        yield
    finally:
        if owned:
            parallel.destroy_distributed()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _build(spec: HFModelSpec, dtype: torch.dtype):
    from m2po_megatron.models.builder import build_gpt_model, transformer_config_from_hf

    tc = transformer_config_from_hf(spec, params_dtype=dtype, pipeline_dtype=dtype, perform_initialization=False)
    return build_gpt_model(spec, tc)


def _build_meta(spec: HFModelSpec, dtype: torch.dtype):
    """The GPTModel without weights (meta device), for its sharded_state_dict. The local spec with CPU
    initialization, because TE layers and GPU initialization allocate on the GPU whatever the default device
    is (the stored keys are the same for both specs). init_model_with_meta_device: with tied embeddings at
    PP > 1, megatron otherwise moves the last stage's output-layer copy to CUDA and all-reduces it with the
    first stage's embedding (a meta tensor has nothing to copy; a CPU machine has no CUDA)."""
    from m2po_megatron.models.builder import build_gpt_model, transformer_config_from_hf

    tc = transformer_config_from_hf(spec, params_dtype=dtype, pipeline_dtype=dtype, perform_initialization=False,
                                    use_cpu_initialization=True, init_model_with_meta_device=True)
    with torch.device("meta"):
        model = build_gpt_model(spec, tc, attention_backend="local")
    real = [n for n, p in model.named_parameters() if not p.is_meta]
    if real:
        raise RuntimeError(f"parameters were allocated off the meta device ({real[:3]}); conversion would write "
                           f"uninitialized memory")
    return model


# ---- HF -> Megatron --------------------------------------------------------------------------------------

def _hf_to_megatron_rank(hf_dir: str, out_tmp: str, dtype: torch.dtype) -> None:
    """Body of one conversion rank (parallel state already initialized). The model is built on the meta
    device and each tensor is made from the HF files only when the writer reaches it (convert.streaming), so memory
    holds one parameter at a time, not the model."""
    from megatron.core import dist_checkpointing

    from m2po_megatron.convert.streaming import MaterializingTorchDistSave
    from m2po_megatron.models.loading import global_named_parameters, shard_position
    from m2po_megatron.models.weights import to_megatron_shard

    spec = read_hf_config(hf_dir)
    model = _build_meta(spec, dtype)
    named = list(global_named_parameters(model))
    names = {id(p): name for name, p in named}
    src = open_hf_source(hf_dir)  # validated once by the caller

    def materialize(meta_param: torch.Tensor) -> torch.Tensor:
        rule, layer = rule_for(spec, names[id(meta_param)])
        tp_rank, tp_size = shard_position(rule)
        shard = to_megatron_shard(spec, rule, [src.get(h) for h in hf_names(rule, layer)], tp_rank, tp_size)
        return shard.to(dtype).contiguous()

    try:
        dist_checkpointing.save({"model": model.sharded_state_dict()}, out_tmp,
                                sharded_strategy=MaterializingTorchDistSave([p for _, p in named], materialize))
    finally:
        src.close()


def _spawned_rank(rank: int, world: int, env: dict, tp: int, pp: int, hf_dir: str, out_tmp: str, dtype,
                  ep: int = 1) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), **env)
    torch.set_num_threads(1)
    from m2po_megatron.actor import parallel

    parallel.init_distributed(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              expert_model_parallel_size=ep)
    try:
        _hf_to_megatron_rank(hf_dir, out_tmp, dtype)
    finally:
        parallel.destroy_distributed()


def hf_to_megatron(hf_dir: str, out_dir: str, *, tensor_model_parallel_size: int = 1,
                   pipeline_model_parallel_size: int = 1, expert_model_parallel_size: int = 1, dtype=None,
                   overwrite: bool = False) -> str:
    """Convert an HF model directory (safetensors) into a Megatron dist checkpoint at out_dir (layout: module
    docstring). The checkpoint loads at any TP/PP/EP layout; tp/pp/ep only choose how many local processes
    share the work (tp x pp x ep of them; with ep > 1 the experts are split over the data-parallel ranks).
    dtype defaults to the dtype of the HF weights. Validates everything before writing; returns out_dir."""
    spec = read_hf_config(hf_dir)
    src = open_hf_source(hf_dir)
    validate_hf_source(spec, src)
    from m2po_megatron.models.builder import validate_layout

    tp, pp, ep = tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size
    world = tp * pp * ep
    validate_layout(spec, tp, pp, ep=ep, world_size=world)
    dtype = parse_dtype(dtype) or src.get("model.embed_tokens.weight").dtype
    src.close()
    with _atomic_dir(out_dir, overwrite) as tmp:
        if world == 1:
            with _single_process_megatron():
                _hf_to_megatron_rank(hf_dir, tmp, dtype)
        else:
            import torch.multiprocessing as mp

            store = serve_rendezvous("127.0.0.1")  # bound now; the ranks join it as clients
            env = rendezvous_env("127.0.0.1", store)
            mp.start_processes(_spawned_rank, args=(world, env, tp, pp, os.path.abspath(hf_dir), tmp, dtype, ep),
                               nprocs=world, start_method="spawn")
        _copy_side_files(hf_dir, os.path.join(tmp, "hf"))
        with open(os.path.join(tmp, CONVERT_META), "w") as f:
            json.dump({"source": os.path.abspath(hf_dir), "dtype": _DTYPE_NAMES[dtype], "architecture":
                       spec.architecture, "converted_at_tp": tp, "converted_at_pp": pp, "converted_at_ep": ep,
                       "state_dict_layout": {"model": "GPTModel.sharded_state_dict()"}}, f, indent=2)
    return out_dir


# ---- Megatron -> HF --------------------------------------------------------------------------------------

def meant_checkpoint(ckpt_dir: str) -> tuple[str, str] | None:
    """(the dist checkpoint a user most likely meant, why) when `ckpt_dir` is a run's checkpoint directory
    rather than one: checkpoints/step_N/ keeps it in step_N/megatron, and checkpoints/ holds the steps."""
    inner = os.path.join(ckpt_dir, "megatron")
    if os.path.isfile(os.path.join(inner, "metadata.json")):
        return inner, "a run's step_N/ keeps it in step_N/megatron"
    steps = []
    if os.path.isdir(ckpt_dir):
        for name in os.listdir(ckpt_dir):
            num = name[len("step_"):]
            if name.startswith("step_") and num.isdigit() and os.path.isfile(
                    os.path.join(ckpt_dir, name, "megatron", "metadata.json")):
                steps.append((int(num), name))
    if steps:
        return os.path.join(ckpt_dir, max(steps)[1], "megatron"), f"the latest of its {len(steps)} step checkpoints"
    return None


def not_a_checkpoint(ckpt_dir: str) -> FileNotFoundError:
    """The error for a directory without metadata.json, with the directory meant where there is one."""
    msg = f"{ckpt_dir} is not a Megatron dist checkpoint (no metadata.json)"
    meant = meant_checkpoint(ckpt_dir)
    return FileNotFoundError(f"{msg}; did you mean {meant[0]}? ({meant[1]})" if meant else msg)


def ckpt_tensor_meta(ckpt_dir: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor's global shape and dtype in a torch_dist checkpoint, from its metadata (no tensor is read)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(ckpt_dir).read_metadata()
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def check_readable(ckpt_dir: str) -> None:
    """Fail naming the file when a dist checkpoint cannot be read: no or unparsable metadata.json, an
    unreadable .metadata index, a *.distcp file missing or shorter than the index says (truncated)."""
    from torch.distributed.checkpoint import FileSystemReader

    mj = os.path.join(ckpt_dir, "metadata.json")
    if not os.path.isfile(mj):
        raise not_a_checkpoint(ckpt_dir)
    hint = "the checkpoint is damaged; restore it or use another one"
    try:
        with open(mj, encoding="utf-8") as f:
            json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{mj} cannot be read as JSON ({e}); {hint}") from None
    try:
        md = FileSystemReader(ckpt_dir).read_metadata()
    except Exception as e:  # noqa: BLE001 - a pickle of any shape: name the file whatever broke
        raise ValueError(f"{os.path.join(ckpt_dir, '.metadata')} cannot be read ({type(e).__name__}: {e}); "
                         f"{hint}") from None
    need: dict[str, int] = {}
    for item in (getattr(md, "storage_data", None) or {}).values():
        need[item.relative_path] = max(need.get(item.relative_path, 0), item.offset + item.length)
    for rel, n in sorted(need.items()):
        p = os.path.join(ckpt_dir, rel)
        if not os.path.isfile(p):
            raise ValueError(f"{p} is missing; {hint}")
        if os.path.getsize(p) < n:
            raise ValueError(f"{p} has {os.path.getsize(p)} bytes but its index needs {n} (truncated); {hint}")


def find_hf_config_dir(ckpt_dir: str, hf_config: str | None) -> str:
    for cand in (hf_config, os.path.join(ckpt_dir, "hf")):
        if cand and os.path.isfile(os.path.join(cand, "config.json")):
            return cand
        if cand and os.path.isfile(cand) and cand.endswith(".json"):
            return os.path.dirname(os.path.abspath(cand))
    raise FileNotFoundError(f"no HF config for {ckpt_dir}: it has no hf/config.json; pass --hf-config DIR "
                            "(the HF model directory the checkpoint came from)")


def validate_megatron_checkpoint(spec: HFModelSpec, ckpt_dir: str, model) -> None:
    """Compare the checkpoint's model tensors with what this config's GPTModel expects (names, global shapes)."""
    from megatron.core.dist_checkpointing import check_is_distributed_checkpoint
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    if not check_is_distributed_checkpoint(ckpt_dir):
        raise not_a_checkpoint(ckpt_dir)
    have = ckpt_tensor_meta(ckpt_dir)
    want = {}
    sd = model.sharded_state_dict()
    apply_factories(sd)  # e.g. the gated fc1 is a factory of gate/up halves under one key
    for v in nested_values(sd):
        if isinstance(v, ShardedTensor):
            want[v.key] = tuple(v.global_shape)
    missing = sorted(k for k in want if k not in have)
    model_prefixes = ("embedding.", "decoder.", "output_layer.")
    unexpected = sorted(k for k in have if k.startswith(model_prefixes) and k not in want)
    bad = [f"{k}: checkpoint {list(have[k][0])} vs config {list(s)}" for k, s in want.items()
           if k in have and have[k][0] != s]
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:20])}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected[:20])}")
    if bad:
        problems.append(f"shape mismatches: {'; '.join(bad[:20])}")
    if problems:
        raise CheckpointMismatchError(f"Megatron checkpoint {ckpt_dir} does not match the {spec.architecture} "
                                      "config: " + " | ".join(problems))


def load_megatron_checkpoint(model, ckpt_dir: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt_dir,
                                     strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    model.load_state_dict(loaded["model"])


def hf_write_plan(spec: HFModelSpec, model, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(hf_name, shape, dtype) in the order the conversion produces them for this (TP1, PP1) model."""
    from m2po_megatron.models.loading import global_named_parameters

    shapes = expected_hf_shapes(spec)
    plan = []
    for mname, _ in global_named_parameters(model):
        if mname == "output_layer.weight" and spec.tie_word_embeddings:
            continue
        rule, layer = rule_for(spec, mname)
        for n in hf_names(rule, layer):
            plan.append((n, tuple(shapes[n]), dtype))
    if sorted(n for n, _, _ in plan) != sorted(expected_hf_names(spec)):
        raise AssertionError("the model's parameters do not cover the HF tensor list")
    return plan


def megatron_to_hf(ckpt_dir: str, out_dir: str, *, hf_config: str | None = None, dtype=None,
                   max_shard_gb: float = 5.0, overwrite: bool = False) -> str:
    """Convert a Megatron dist checkpoint (from hf_to_megatron or the actor) to an HF directory: sharded
    safetensors + index, config.json, generation config and tokenizer files when available. Reads one decoder
    parameter at a time and writes each tensor as it comes (no shard is held). dtype defaults to the
    checkpoint's."""
    from m2po_megatron.convert.hf_writer import ShardedSafetensorsWriter

    if not os.path.isfile(os.path.join(ckpt_dir, "metadata.json")) and meant_checkpoint(ckpt_dir):
        raise not_a_checkpoint(ckpt_dir)  # a run's step directory: say so before asking for its HF config
    cfg_dir = find_hf_config_dir(ckpt_dir, hf_config)
    check_readable(ckpt_dir)
    spec = read_hf_config(cfg_dir)
    from megatron.core.dist_checkpointing import check_is_distributed_checkpoint

    if not check_is_distributed_checkpoint(ckpt_dir):
        raise not_a_checkpoint(ckpt_dir)
    meta = ckpt_tensor_meta(ckpt_dir)
    emb = meta.get("embedding.word_embeddings.weight")
    ckpt_dtype = emb[1] if emb else torch.float32
    out_dtype = parse_dtype(dtype) or ckpt_dtype
    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"output {out_dir} exists; remove it or pass overwrite (--overwrite)")
    with _single_process_megatron():
        model = _build_meta(spec, ckpt_dtype)  # shapes and sharding only; tensors are read one at a time
        validate_megatron_checkpoint(spec, ckpt_dir, model)
        with _atomic_dir(out_dir, overwrite) as tmp:
            writer = ShardedSafetensorsWriter(tmp, hf_write_plan(spec, model, out_dtype), int(max_shard_gb * 2**30))
            for name, t in _iter_hf_tensors_from_checkpoint(spec, model, ckpt_dir):
                writer.add(name, t.to(out_dtype).contiguous())
            writer.close()
            _copy_side_files(cfg_dir, tmp, dtype=out_dtype)
        del model
    return out_dir


def _iter_hf_tensors_from_checkpoint(spec: HFModelSpec, meta_model, ckpt_dir: str):
    """(hf_name, tensor) in hf_write_plan order, reading one parameter at a time from the dist checkpoint
    (its layer's slab of each stacked tensor), so the model is never held whole. The meta model (TP1/PP1)
    says, per parameter, which stored chunks hold it and where they go (the swiglu fc1 is two)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from m2po_megatron.convert.streaming import read_chunks, storage_key
    from m2po_megatron.models.loading import global_named_parameters

    sharded = meta_model.sharded_state_dict()
    apply_factories(sharded)
    pieces: dict[int, list[ShardedTensor]] = {}
    for sh in nested_values(sharded):
        if isinstance(sh, ShardedTensor):
            pieces.setdefault(storage_key(sh.data), []).append(sh)
    for name, p in global_named_parameters(meta_model):
        if name == "output_layer.weight" and spec.tie_word_embeddings:
            continue
        real = torch.empty(p.shape, dtype=p.dtype)
        chunks = []
        for sh in pieces[storage_key(p)]:
            view = real.as_strided(sh.data.size(), sh.data.stride(), sh.data.storage_offset() - p.storage_offset())
            # stacked tensors carry `prepend_axis_num` leading axes (the layer) of size 1 per parameter
            chunks.append((sh.key, tuple(sh.global_offset),
                           view.view((1,) * sh.prepend_axis_num + tuple(sh.local_shape))))
        read_chunks(ckpt_dir, chunks)
        rule, layer = rule_for(spec, name)
        yield from to_hf(spec, rule, [real], layer)


# ---- --verify --------------------------------------------------------------------------------------------

@torch.no_grad()
def verify_logits(hf_dir: str, ckpt_dir: str, *, seq_len: int = 32, batch: int = 2, seed: int = 0) -> float:
    """Max |logits_HF - logits_Megatron| for the same random token ids (both models in fp32, TP1, this process).
    The HF side is loaded with transformers.AutoModelForCausalLM from hf_dir."""
    import transformers

    spec = read_hf_config(hf_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    ids = torch.randint(0, spec.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed))
    ref = hf(input_ids=ids).logits.float()
    del hf
    meta = ckpt_tensor_meta(ckpt_dir)
    ckpt_dtype = meta["embedding.word_embeddings.weight"][1]
    with _single_process_megatron():
        model = _build(spec, ckpt_dtype)
        validate_megatron_checkpoint(spec, ckpt_dir, model)
        load_megatron_checkpoint(model, ckpt_dir)
        model = model.float()
        from m2po_megatron.infra.device import device

        pos = torch.arange(seq_len).unsqueeze(0).expand(batch, -1)
        out = model(input_ids=ids.to(device()), position_ids=pos.to(device()), attention_mask=None).float().cpu()
    return float((out - ref).abs().max())


__all__ = ["hf_to_megatron", "megatron_to_hf", "verify_logits", "validate_megatron_checkpoint",
           "find_hf_config_dir", "parse_dtype", "expected_hf_names", "CheckpointMismatchError"]
