"""Per-GPU memory of a colocated layout (cluster.colocate): a trainer rank and an SGLang engine's TP rank share
each GPU, and each phase of a step has its own peak.

- **generation**: the engine holds its weights, its KV pool and its CUDA graphs and activations, while the
  trainer's weights, gradients and optimizer states sit on the host. What the trainer leaves on the GPU then
  is TRAINER_OFFLOADED_GB. The engine's weights are its parameters in its dtype over its TP. SGLang sizes
  the KV pool at start-up to mem_fraction_static of the GPU, less the weights and whatever else is resident
  then (the trainer's share here). That is the rollout estimate plan/costs.py prices (kv_pool), with the
  trainer's share taken off. The rest of the GPU, (1 - mem_fraction_static), is SGLang's room for CUDA
  graphs and activations. The phase cannot run when the KV pool cannot hold one sequence of the longest
  context (prompt + max_new_tokens + the 2 positions SGLang keeps): SGLang then refuses a request of that
  length, or refuses to start when the pool is empty.
- **training**: the trainer's own estimate (models/memory.py, whose fixed overhead already counts its CUDA
  context, NCCL buffers and fragmentation) plus what the engine leaves resident after it releases its
  weights, KV cache and CUDA graphs (ENGINE_RELEASED_GB).
- **weight_sync**: the moment of run/colocation.to_generate between the engines' resume of their weights and
  the trainer's offload. The trainer is still loaded but its step is over: its static part (weights, grads,
  optimizer states, fixed overhead, and a reference model's weights when they stay on the GPU; the
  activations and the optimizer step's temporaries are freed), the engine's weights again (resumed, then
  overwritten by update_weights_from_tensor), what the released engine keeps (ENGINE_RELEASED_GB), and the
  HF-layout buckets the trainer's sender builds on the same GPU (rollout.bucket_mb each, SYNC_BUCKETS_HELD of
  them; sync_bucket_bytes). The engine's KV pool and CUDA graphs come back only after the trainer has
  offloaded. "Freed" means given back to the device: blocks that torch's caching allocator still holds stay
  reserved for the trainer's process, where the buckets can reuse them but the engine's weights cannot.

The step's peak is the largest of the three. With the GPU's memory known, the generation phase fills it by
SGLang's design (its KV pool takes what is left); what is checked is whether that pool holds the longest
sequence. Units: GiB, as models/memory.py. Pure arithmetic.
"""
from __future__ import annotations

import math
from typing import Optional

from m2po_megatron.models.memory import BYTES, GiB, model_shape, param_count

# Generation phase: what a trainer rank keeps on the GPU while offloaded. torch_memory_saver pauses every
# allocation that torch's caching allocator made inside its region (weights, main grads, optimizer states and
# the allocator's cache of them), so what stays is memory made outside it: the CUDA context with torch's and
# megatron's kernels loaded (about 0.5 GiB on H100) and the NCCL communicators' buffers. An assumption, not a
# measurement on this project's GPUs: the gpu check can measure it (torch.cuda.mem_get_info while offloaded).
TRAINER_OFFLOADED_GB = 1.0
# Training phase: what an SGLang engine's TP rank keeps after POST /release_memory_occupation with the tags
# kv_cache, weights and cuda_graph: its CUDA context and the blocks its allocator made outside
# torch_memory_saver's regions (sampling buffers, its TP group's NCCL buffers, the caching allocator's reserve).
# Also an assumption, not measured here; slime and verl leave a similar margin under the trainer.
ENGINE_RELEASED_GB = 2.0
# SGLang picks mem_fraction_static from the GPU's memory and TP when the flag is not given; plan/costs.py
# prices a server at 0.85, and so does this when rollout.mem_fraction_static is null.
DEFAULT_MEM_FRACTION_STATIC = 0.85
ENGINE_WEIGHT_BYTES = {None: 2, "fp8": 1}  # bf16 weights, or SGLang's fp8 quantization (rollout.quantization)
RESERVED_POSITIONS = 2  # SGLang never generates into a context's last 2 positions (rollout/protocol.py)
# Weight-sync phase: rollout.bucket_mb's default (config/schema.py), the MiB per bucket that
# convert/export.iter_hf_weight_buckets groups the HF tensors into; a tensor larger than that is a bucket alone.
SYNC_BUCKET_MB = 512
# rollout/tensor_sync.send_all still references the bucket it just sent (its loop variable) while the export
# builds the next one, so a sender holds two buckets at once.
SYNC_BUCKETS_HELD = 2
TRAINER_STATIC = ("weights", "grads", "optimizer", "overhead")  # models/memory.py's parts that outlive a step
PHASES = ("generation", "training", "weight_sync")


def engine_kv_bytes_per_token(hf_config: dict, rollout_tp: int) -> float:
    """K and V of one token in bf16 on one GPU of an engine of TP `rollout_tp`; past kv_heads, SGLang
    replicates the KV heads (plan/costs.kv_bytes_per_gpu prices the same)."""
    s = model_shape(hf_config)
    return 2 * s.layers * math.ceil(s.kv_heads / rollout_tp) * s.head_dim * 2


def sync_bucket_bytes(hf_config: dict, bucket_mb: float = SYNC_BUCKET_MB, tensor_bytes: int = 2) -> int:
    """Bytes of the largest bucket convert/export.hf_buckets yields: `bucket_mb` MiB, or the largest single
    HF tensor when that is larger (it goes alone): the embedding or output layer [vocab, hidden] in practice,
    else an MLP projection or the query projection. `tensor_bytes`: the trainer's params dtype (bf16: 2)."""
    s = model_shape(hf_config)
    largest = max(s.vocab, s.expert_ffn if s.experts else s.ffn, s.q_dim) * s.hidden * tensor_bytes
    return max(int(bucket_mb * 1024 * 1024), largest)


def estimate_colocated(hf_config: dict, trainer: dict, *, rollout_tp: int, context_tokens: int,
                       gpu_memory_gb: Optional[float] = None, mem_fraction_static: Optional[float] = None,
                       quantization: Optional[str] = None, bucket_mb: float = SYNC_BUCKET_MB,
                       tensor_bytes: int = 2) -> dict:
    """Each phase's peak per GPU in GiB. `trainer`: estimate_gpu_memory's result for the trainer layout (its
    total and its TRAINER_STATIC parts); `context_tokens`: the longest sequence an engine must hold (prompt +
    new tokens + reserved positions). Without `gpu_memory_gb` the KV pool is the least it must be (one
    sequence of the longest context). `bucket_mb`, `tensor_bytes`: the weight sync's buckets
    (sync_bucket_bytes). Returns {"generation": {...}, "training": {...}, "weight_sync": {...}, "peak",
    "peak_phase", "over": {phase: GiB over}}."""
    if rollout_tp < 1:
        raise ValueError(f"rollout.tp_size = {rollout_tp} must be >= 1")
    missing = [k for k in ("total", *TRAINER_STATIC) if k not in trainer]
    if missing:
        raise ValueError(f"the trainer's estimate lacks {missing} (pass models/memory.estimate_gpu_memory's result)")
    mfs = DEFAULT_MEM_FRACTION_STATIC if mem_fraction_static is None else float(mem_fraction_static)
    weights = param_count(hf_config) * ENGINE_WEIGHT_BYTES.get(quantization, 2) / rollout_tp / GiB
    kv_min = context_tokens * engine_kv_bytes_per_token(hf_config, rollout_tp) / GiB
    gen = {"trainer_offloaded": TRAINER_OFFLOADED_GB, "engine_weights": weights, "kv_min": kv_min}
    over: dict[str, float] = {}
    if gpu_memory_gb:
        # SGLang's start-up sizing: mem_fraction_static of the GPU, less the weights and the trainer's share
        gen["kv_pool"] = gpu_memory_gb * mfs - weights - TRAINER_OFFLOADED_GB
        gen["graphs_activations"] = gpu_memory_gb * (1 - mfs)
        if gen["kv_pool"] < kv_min:
            over["generation"] = kv_min - gen["kv_pool"]
    else:
        gen["kv_pool"] = kv_min
        gen["graphs_activations"] = 0.0  # unknown without the GPU's memory: SGLang takes (1 - fraction) of it
    gen["total"] = (TRAINER_OFFLOADED_GB + weights + max(gen["kv_pool"], kv_min) + gen["graphs_activations"])
    train = {"trainer": trainer["total"], "engine_released": ENGINE_RELEASED_GB}
    train["total"] = trainer["total"] + ENGINE_RELEASED_GB
    if gpu_memory_gb and train["total"] > gpu_memory_gb:
        over["training"] = train["total"] - gpu_memory_gb
    # a reference model kept on the GPU (algo.ref_param_offload = false) is resident here too
    static = sum(trainer[k] for k in TRAINER_STATIC) + trainer.get("reference_on_gpu", 0.0)
    sync = {"trainer_static": static, "engine_weights": weights,
            "buckets": SYNC_BUCKETS_HELD * sync_bucket_bytes(hf_config, bucket_mb, tensor_bytes) / GiB,
            "engine_released": ENGINE_RELEASED_GB, "bucket_mb": bucket_mb}
    sync["total"] = sync["trainer_static"] + weights + sync["buckets"] + ENGINE_RELEASED_GB
    if gpu_memory_gb and sync["total"] > gpu_memory_gb:
        over["weight_sync"] = sync["total"] - gpu_memory_gb
    phases = {"generation": gen, "training": train, "weight_sync": sync}
    peak_phase = max(PHASES, key=lambda p: phases[p]["total"])
    return {**phases, "peak": phases[peak_phase]["total"], "peak_phase": peak_phase, "over": over,
            "mem_fraction_static": mfs, "rollout_tp": rollout_tp, "gpu_memory_gb": gpu_memory_gb}


def colocated_from_config(cfg, hf_config: dict, trainer: dict, gpu_memory_gb: Optional[float] = None) -> dict:
    """estimate_colocated for a run config (its rollout section and cluster.gpu_memory_gb, or
    `gpu_memory_gb` when the GPU is known otherwise)."""
    r = cfg.rollout
    context = (r.context_length or cfg.data.max_prompt_len + r.max_new_tokens + RESERVED_POSITIONS)
    # the buckets carry the trainer's parameters as they are: params_dtype, auto being bf16 on GPUs
    dtype = cfg.model.params_dtype
    dtype = ("bf16" if cfg.cluster.gpus_per_node > 0 else "fp32") if dtype == "auto" else dtype
    return estimate_colocated(hf_config, trainer, rollout_tp=int(r.tp_size), context_tokens=int(context),
                              gpu_memory_gb=gpu_memory_gb or cfg.cluster.gpu_memory_gb,
                              mem_fraction_static=r.mem_fraction_static, quantization=r.quantization,
                              bucket_mb=r.bucket_mb, tensor_bytes=BYTES.get(dtype, 2))


def phase_errors(est: dict) -> list[str]:
    """One error per phase that cannot fit, naming the phase, by how much, and the fix."""
    out = []
    gpu = est["gpu_memory_gb"]
    if "generation" in est["over"]:
        g = est["generation"]
        out.append(
            f"cluster.colocate: the generation phase does not fit cluster.gpu_memory_gb = {gpu:g}: the engine's KV "
            f"pool would be {g['kv_pool']:.1f} GiB per GPU (mem_fraction_static {est['mem_fraction_static']:g} of "
            f"the GPU, less {g['engine_weights']:.1f} GiB of weights at rollout.tp_size = {est['rollout_tp']} and "
            f"{g['trainer_offloaded']:.1f} GiB the offloaded trainer keeps), {est['over']['generation']:.1f} GiB "
            f"short of one sequence of the longest context ({g['kv_min']:.2f} GiB); raise rollout.tp_size or "
            f"rollout.mem_fraction_static, or lower rollout.max_new_tokens ({format_colocated(est)})")
    if "training" in est["over"]:
        t = est["training"]
        out.append(
            f"cluster.colocate: the training phase does not fit cluster.gpu_memory_gb = {gpu:g}: the trainer's "
            f"{t['trainer']:.1f} GiB plus the {t['engine_released']:.1f} GiB the released engine keeps is "
            f"{t['total']:.1f} GiB per GPU, {est['over']['training']:.1f} GiB over; raise tensor/pipeline parallel "
            f"size or lower train.micro_batch_tokens ({format_colocated(est)})")
    if "weight_sync" in est["over"]:
        w = est["weight_sync"]
        out.append(
            f"cluster.colocate: the weight_sync phase does not fit cluster.gpu_memory_gb = {gpu:g}: while the "
            f"engines take their weights back and receive the new ones, the trainer still holds "
            f"{w['trainer_static']:.1f} GiB (weights, grads, optimizer states, overhead), the engine "
            f"{w['engine_weights']:.1f} GiB of weights at rollout.tp_size = {est['rollout_tp']} plus the "
            f"{w['engine_released']:.1f} GiB it keeps released, and the sync {w['buckets']:.1f} GiB of buckets "
            f"(rollout.bucket_mb = {w['bucket_mb']:g}): {w['total']:.1f} GiB per GPU, "
            f"{est['over']['weight_sync']:.1f} GiB over; raise rollout.tp_size (or rollout.quantization = fp8), "
            f"raise tensor/pipeline parallel size, or lower rollout.bucket_mb ({format_colocated(est)})")
    return out


def format_colocated(est: dict) -> str:
    g, t, w = est["generation"], est["training"], est["weight_sync"]
    kv = "KV pool" if est["gpu_memory_gb"] else "KV for one longest sequence"
    return (f"generation: trainer offloaded {g['trainer_offloaded']:.1f}, engine weights {g['engine_weights']:.1f}, "
            f"{kv} {g['kv_pool']:.1f}, CUDA graphs and activations {g['graphs_activations']:.1f} -> "
            f"{g['total']:.1f} GiB; training: trainer {t['trainer']:.1f}, released engine "
            f"{t['engine_released']:.1f} -> {t['total']:.1f} GiB; weight_sync: trainer without activations "
            f"{w['trainer_static']:.1f}, engine weights {w['engine_weights']:.1f}, buckets {w['buckets']:.1f}, "
            f"released engine {w['engine_released']:.1f} -> {w['total']:.1f} GiB; "
            f"peak {est['peak']:.1f} GiB ({est['peak_phase']})")
