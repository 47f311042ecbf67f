"""Per-GPU memory estimate of a megatron-core trainer rank, from an HF config.json and a parallel layout.

An upper-bound style estimate used to reject layouts that cannot fit before any GPU is touched. The formula
(documented with its assumptions in docs/cluster.md, "Memory estimate"):

  weights    = P_rank x bytes(params_dtype)                 (+1 byte/linear param with FP8: TE's cast copy)
  grads      = P_rank x 4 (fp32 main grads, Megatron's default for bf16) or 2 when grad_reduce_in_fp32=False
  optimizer  = P_rank x 12 (fp32 master copy + Adam m + v) / DP with the distributed optimizer
  activations= tokens x layers_in_flight x per-layer bytes (Korthikanti et al. 2022, adapted to GQA, SwiGLU
               and flash attention; no attention-score matrix is stored)
  logits     = tokens x vocab/TP x 12 bytes on the last stage (fp32 logits, fp32 softmax, fp32 temp)
  overhead   = CUDA context, NCCL buffers and allocator fragmentation (a fixed allowance)

P_rank is the parameter count of the heaviest pipeline stage on one tensor-parallel rank. Units: GiB.
Pure arithmetic: no torch, no Megatron.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

GiB = 1024**3
BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
RECOMPUTE = (None, "none", "selective", "full")


@dataclass(frozen=True)
class ModelShape:
    """The numbers of an HF decoder config that decide its size."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


def model_shape(hf_config: dict) -> ModelShape:
    """Read the size-relevant fields of a Llama/Qwen2/Qwen3-style config.json; a missing one is an error."""
    need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in need if not hf_config.get(k)]
    if missing:
        raise ValueError(f"HF config lacks {missing}; give the model's config.json (model.hf_config)")
    h, heads = int(hf_config["hidden_size"]), int(hf_config["num_attention_heads"])
    mtype = str(hf_config.get("model_type", ""))
    return ModelShape(
        hidden=h,
        layers=int(hf_config["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(hf_config.get("num_key_value_heads") or heads),
        head_dim=int(hf_config.get("head_dim") or h // heads),
        ffn=int(hf_config["intermediate_size"]),
        vocab=int(hf_config["vocab_size"]),
        tied=bool(hf_config.get("tie_word_embeddings", False)),
        # Qwen2/2.5 have q/k/v biases; Llama and Qwen3 say so with attention_bias (default False)
        qkv_bias=bool(hf_config.get("attention_bias", mtype == "qwen2")),
        qk_norm=mtype.startswith("qwen3"),
    )


def layer_params(s: ModelShape) -> tuple[int, int]:
    """(tensor-parallel-split parameters, replicated parameters) of one decoder layer."""
    split = s.hidden * (s.q_dim + 2 * s.kv_dim) + s.q_dim * s.hidden + 3 * s.hidden * s.ffn
    if s.qkv_bias:
        split += s.q_dim + 2 * s.kv_dim
    replicated = 2 * s.hidden + (2 * s.head_dim if s.qk_norm else 0)
    return split, replicated


def param_count(hf_config: dict) -> int:
    """Total parameters of the HF model (embeddings counted once when tied)."""
    s = model_shape(hf_config)
    split, rep = layer_params(s)
    emb = s.vocab * s.hidden
    return s.layers * (split + rep) + emb * (1 if s.tied else 2) + s.hidden


def _stage_params(s: ModelShape, tp: int, pp: int) -> tuple[float, float]:
    """(params, linear params) on one TP rank of the heaviest pipeline stage."""
    split, rep = layer_params(s)
    per_stage = s.layers // pp
    body = per_stage * (split / tp + rep)
    emb = s.vocab * s.hidden / tp  # vocab-parallel embedding / output layer
    # first stage: embedding; last stage: final norm + output layer (Megatron keeps a copy of a tied
    # embedding on the last stage when pp > 1); pp == 1: one stage holds all of it
    if pp == 1:
        extra = emb * (1 if s.tied else 2) + s.hidden
        lin_extra = 0 if s.tied else emb
    else:
        extra = emb + s.hidden  # the last stage is the heavier of the two ends
        lin_extra = emb
    linear = per_stage * split / tp + lin_extra
    return body + extra, linear


def _layer_activation_bytes(s: ModelShape, tp: int, sp: bool, fp8: bool) -> float:
    """Bytes saved for backward by one decoder layer per token (bf16 activations, flash attention)."""
    lin_in = 1 if fp8 else 2  # TE keeps FP8 copies of linear inputs
    # replicated across TP unless sequence parallel: norm inputs (2) and QKV / fc1 inputs
    seq = 2 * s.hidden * 2 + 2 * s.hidden * lin_in
    # split across TP: q, k, v and attention output (flash attention backward), proj input,
    # SwiGLU's gate and up outputs, fc2 input
    split = (2 * (s.q_dim + 2 * s.kv_dim) + 2 * s.q_dim + lin_in * s.q_dim
             + 2 * 2 * s.ffn + lin_in * s.ffn)
    return seq / (tp if sp else 1) + split / tp


def estimate_gpu_memory(
    hf_config: dict,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    data_parallel_size: int = 1,
    micro_batch_tokens: int = 4096,
    use_distributed_optimizer: bool = True,
    params_dtype: str = "bf16",
    fp8: bool = False,
    sequence_parallel: bool = False,
    recompute: Optional[str] = None,
    context_parallel_size: int = 1,
    grad_reduce_in_fp32: bool = True,
    microbatches_in_flight: Optional[int] = None,
    overhead_gb: float = 4.0,
) -> dict[str, float]:
    """Estimated peak memory of one trainer GPU in GiB: weights, grads, optimizer, activations, logits,
    overhead and total. `micro_batch_tokens` is the packed token budget of one micro-batch (split across
    context parallel ranks); `recompute` is Megatron's recompute_granularity (None, "selective", "full").
    `microbatches_in_flight` defaults to the pipeline depth (1F1B keeps up to PP micro-batches on stage 0).
    """
    tp, pp, dp, cp = (int(tensor_model_parallel_size), int(pipeline_model_parallel_size),
                      int(data_parallel_size), int(context_parallel_size))
    for name, v in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                    ("data_parallel_size", dp), ("context_parallel_size", cp),
                    ("micro_batch_tokens", micro_batch_tokens)):
        if v < 1:
            raise ValueError(f"{name} = {v} must be >= 1")
    if params_dtype not in BYTES:
        raise ValueError(f"params_dtype = {params_dtype!r} must be one of {sorted(BYTES)}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute = {recompute!r} must be one of {RECOMPUTE}")
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel needs tensor_model_parallel_size > 1")
    s = model_shape(hf_config)
    if s.heads % tp or s.kv_heads % tp:
        raise ValueError(f"tensor_model_parallel_size = {tp} must divide num_attention_heads = {s.heads} "
                         f"and num_key_value_heads = {s.kv_heads}")
    if s.layers % pp:
        raise ValueError(f"pipeline_model_parallel_size = {pp} must divide num_hidden_layers = {s.layers}")

    p_rank, p_linear = _stage_params(s, tp, pp)
    pbytes = BYTES[params_dtype]
    mixed = pbytes < 4
    weights = p_rank * pbytes + (p_linear if fp8 else 0)
    grads = p_rank * (4 if (grad_reduce_in_fp32 or not mixed) else 2)
    opt_bytes = 12 if mixed else 8  # fp32 master + m + v, or m + v when the params are fp32
    optimizer = p_rank * opt_bytes / (dp * cp if use_distributed_optimizer else 1)

    tokens = micro_batch_tokens / cp
    per_layer = _layer_activation_bytes(s, tp, sequence_parallel, fp8) * (pbytes / 2 if not mixed else 1)
    layers_stage = s.layers // pp
    in_flight = microbatches_in_flight if microbatches_in_flight is not None else pp
    if recompute == "full":
        # only each layer's input is kept; one layer's activations are rebuilt at a time
        kept = 2 * s.hidden / (tp if sequence_parallel else 1)
        act = tokens * (layers_stage * in_flight * kept + per_layer)
    else:  # "selective" recomputes core attention, which flash attention never stores anyway
        act = tokens * layers_stage * in_flight * per_layer
    # the last stage also computes log-probs over the vocab-parallel logits
    logits = tokens * s.vocab / tp * 12

    out = {
        "weights": weights / GiB,
        "grads": grads / GiB,
        "optimizer": optimizer / GiB,
        "activations": act / GiB,
        "logits": logits / GiB,
        "overhead": float(overhead_gb),
    }
    out["total"] = sum(out.values())
    out["params_per_gpu_billion"] = p_rank / 1e9
    return out


def load_hf_config(path: str | Path) -> dict:
    """config.json (or a directory holding it) as a dict."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    return json.loads(p.read_text())


def format_estimate(est: dict[str, float]) -> str:
    keys = ("weights", "grads", "optimizer", "activations", "logits", "overhead")
    return ", ".join(f"{k} {est[k]:.1f}" for k in keys) + f" -> total {est['total']:.1f} GiB"
