"""Per-GPU memory estimate of a megatron-core trainer rank, from an HF config.json and a parallel layout.

Used to reject layouts that cannot fit before any GPU is touched. The formula (the per-token byte accounting
is written out in docs/cluster.md, "Memory estimate"):

  weights    = P_rank x bytes(params_dtype)                 (+1 byte/linear param with FP8: TE's cast copy)
  grads      = P_rank x 4 (fp32 main grads, Megatron's default for bf16) or 2 when grad_reduce_in_fp32=False
  optimizer  = P_rank x 12 (fp32 master copy + Adam m + v) / DP with the distributed optimizer
  activations= tokens x layers_in_flight x what one decoder layer saves for backward per token, counted
               tensor by tensor for the attention backend as built (layer_saved_elements)
  logits     = what actor.fused_logprobs builds on the last stage instead of [S, V/TP] logits: per token the
               response row's hidden state and four per-row vectors kept for backward, one chunk of logit
               rows at a time, and in backward the output weight's gradient ([V/TP, H], summed in fp32) and
               the hidden states' gradient (logprob_bytes)
  optimizer_step = P_rank x 4 / DP: torch's foreach AdamW (megatron's optimizer without TE/Apex) makes one
               fp32 temporary per parameter during the step, when the activations are already freed
  overhead   = CUDA context, NCCL buffers and allocator fragmentation (a fixed allowance)

total = weights + grads + optimizer + max(activations + logits, optimizer_step) + overhead. With a reference
model (algo.use_kl_loss) its weights and its forward-only pass are a phase of their own, or its weights are
resident in every phase (models/reference_memory.py); total is then the larger phase. P_rank is the
parameter count of the heaviest pipeline stage on one tensor-parallel rank. Units: GiB. Pure arithmetic:
no torch, no Megatron. The tensor terms (total - overhead) are meant to be within MARGIN of the allocator's
peak (torch.cuda.max_memory_allocated) for the backend that ran; the gpu test checks it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from m2po_megatron.models.moe_memory import (check_expert_layout, dispatcher_state_bytes, expert_data_parallel,
                                             expert_layer_params, moe_saved_elements, replay_bytes, router_params)
from m2po_megatron.models.reference_memory import add_reference, format_reference, forward_only_bytes

GiB = 1024**3
BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
RECOMPUTE = (None, "none", "selective", "full")
ATTENTION_BACKENDS = ("te", "sdpa", "local")
MARGIN = 0.15  # stated accuracy of the tensor terms against the allocator's peak
LOGPROB_CHUNK_BYTES = 256 * 1024**2  # actor.fused_logprobs.CHUNK_BYTES
LOGPROB_VOCAB_BLOCK = 16384  # actor.fused_logprobs.VOCAB_BLOCK


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
    # mixture of experts (0 experts: dense; then ffn is the MLP's): E experts of expert_ffn, top-k per token
    experts: int = 0
    topk: int = 0
    expert_ffn: int = 0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


def model_shape(hf_config) -> ModelShape:
    """The size-relevant facts of a supported config (dict, directory or config.json), as
    models.hf_config.read_hf_config reads them for building the model (UnsupportedModelError otherwise)."""
    from m2po_megatron.models.hf_config import read_hf_config

    spec = read_hf_config(hf_config)
    return ModelShape(hidden=spec.hidden_size, layers=spec.num_layers, heads=spec.num_attention_heads,
                      kv_heads=spec.num_key_value_heads, head_dim=spec.head_dim, ffn=spec.intermediate_size,
                      vocab=spec.vocab_size, tied=spec.tie_word_embeddings, qkv_bias=spec.qkv_bias,
                      qk_norm=spec.qk_norm, experts=spec.num_experts, topk=spec.num_experts_per_tok,
                      expert_ffn=spec.moe_intermediate_size)


def layer_params(s: ModelShape) -> tuple[int, int]:
    """(tensor-parallel-split parameters, replicated parameters) of one decoder layer. A MoE layer's experts
    are neither (split over expert ranks: moe_memory.expert_layer_params); its router is replicated."""
    mlp = 0 if s.experts else 3 * s.hidden * s.ffn
    split = s.hidden * (s.q_dim + 2 * s.kv_dim) + s.q_dim * s.hidden + mlp
    if s.qkv_bias:
        split += s.q_dim + 2 * s.kv_dim
    replicated = 2 * s.hidden + (2 * s.head_dim if s.qk_norm else 0)
    if s.experts:
        replicated += router_params(s)
    return split, replicated


def param_count(hf_config: dict) -> int:
    """Total parameters of the HF model (embeddings counted once when tied; every expert)."""
    s = model_shape(hf_config)
    split, rep = layer_params(s)
    emb = s.vocab * s.hidden
    return s.layers * (split + rep + expert_layer_params(s)) + emb * (1 if s.tied else 2) + s.hidden


def active_param_count(hf_config: dict) -> int:
    """Parameters one token goes through: param_count with each MoE layer's top-k experts instead of all of
    them (the input embedding is a lookup but counted, as model cards count it). Dense: param_count."""
    s = model_shape(hf_config)
    split, rep = layer_params(s)
    experts = expert_layer_params(s) * s.topk // s.experts if s.experts else 0
    emb = s.vocab * s.hidden
    return s.layers * (split + rep + experts) + emb * (1 if s.tied else 2) + s.hidden


def _stage_params(s: ModelShape, tp: int, pp: int, stage: Optional[int] = None, ep: int = 1,
                  etp: int = 1) -> tuple[float, float, float]:
    """(params, linear params, expert params) on one TP rank of pipeline stage `stage` (None: the heaviest);
    the expert params (a share of params) are this rank's E / ep experts, each split over etp ranks."""
    split, rep = layer_params(s)
    per_stage = s.layers // pp
    expert = per_stage * expert_layer_params(s) / (ep * etp)
    body = per_stage * (split / tp + rep) + expert
    emb = s.vocab * s.hidden / tp  # vocab-parallel embedding / output layer
    # first stage: embedding; last stage: final norm + output layer (Megatron keeps a copy of a tied
    # embedding on the last stage when pp > 1); pp == 1: one stage holds all of it
    if pp == 1:
        extra = emb * (1 if s.tied else 2) + s.hidden
        lin_extra = 0 if s.tied else emb
    elif stage is not None and stage < pp - 1:
        extra = emb if stage == 0 else 0.0  # the input embedding (a lookup, not a linear layer)
        lin_extra = 0.0
    else:
        extra = emb + s.hidden  # the last stage is the heavier of the two ends
        lin_extra = emb
    linear = per_stage * split / tp + lin_extra + expert
    return body + extra, linear, expert


def layer_saved_elements(s: ModelShape, tp: int = 1, sequence_parallel: bool = False, fp8: bool = False,
                         attention_backend: str = "sdpa", row_tokens: int = 0, recompute: Optional[str] = None,
                         cuda_kernels: bool = True, etp: Optional[int] = None,
                         aux_loss: bool = False) -> tuple[float, float, float]:
    """What one decoder layer saves for backward per token: (elements in the activation dtype, FP8 bytes,
    fp32 elements), tensor by tensor, on one TP rank. `row_tokens` (the packed row length) matters only for
    the "local" backend's S x S scores. cuda_kernels: the kernels a CUDA machine runs: torch's fused RMSNorm
    (saves its input and an fp32 rstd; torch uses it because the norm weights are built in the params dtype,
    models/norm.py) and the compiled flex attention; False gives what the CPU runs (torch's composite RMSNorm
    keeps fp32 copies of the input and of the normalised input; torch's reference flex also keeps a row max),
    which tests/actor/test_memory_saved.py measures against autograd's saved tensors in bf16. SwiGLU is
    megatron's fused Function on every device (saves its input). (fp32 activations, CPU only, share some of
    the counted copies: the estimate is for bf16.) A MoE layer's MLP is moe_memory.moe_saved_elements (etp:
    expert tensor parallel, default tp; aux_loss: the load-balancing loss is on), its int64 indices counted as
    two fp32 elements each."""
    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend = {attention_backend!r} must be one of {ATTENTION_BACKENDS}")
    rep = 1.0 / (tp if sequence_parallel else 1)  # hidden-sized tensors: sharded only by sequence parallel
    h, hd = s.hidden, s.head_dim
    q, kv, f = s.q_dim / tp, s.kv_dim / tp, s.ffn / tp
    heads, groups = s.heads / tp, s.kv_heads / tp
    lin = 0.0 if fp8 else 1.0  # linear inputs: kept in the activation dtype, or as an FP8 byte
    act = fp8b = f32 = 0.0
    # input_layernorm and pre_mlp_layernorm
    if cuda_kernels:
        act += 2 * h * rep
        f32 += 2 * rep
    else:
        f32 += 2 * (2 * h + 1) * rep
    # linear_qkv and linear_fc1 inputs (the two norms' outputs); a MoE layer's router keeps the second
    # (moe_saved_elements)
    n_in = 1 if s.experts else 2
    act += n_in * h * rep * lin
    fp8b += n_in * h * rep * (1 - lin)
    # q_layernorm / k_layernorm (Qwen3): q is a reshaped copy of linear_qkv's output, k a view of it
    if s.qk_norm:
        if cuda_kernels:
            act += q
            f32 += heads + groups
        else:
            f32 += 2 * (q + kv) + heads + groups
    act += 4 * hd  # RoPE's cos and sin, for q and for k (one position each, shared by the heads)
    selective = recompute == "selective"
    if attention_backend == "local":  # megatron's DotProductAttention over a dense block-diagonal mask
        gqa = heads != groups
        # linear_qkv's output stays alive when a view of it is saved: v (not repeated, or kept by the
        # recompute checkpoint) or k (fused k_layernorm)
        qkv_alive = (s.qk_norm and cuda_kernels) or not gqa or selective
        act += (q + 2 * kv) if qkv_alive else 0.0
        if selective:  # the checkpoint keeps q and k as they enter core attention
            act += q + kv
        else:
            act += q + (q if gqa else kv) + (q if gqa else 0.0)  # q; k and v repeated to every head
            act += heads * row_tokens  # softmax output in the activation dtype (bmm input) ...
            f32 += heads * row_tokens  # ... and in fp32 (attention_softmax_in_fp32)
        act += q * lin  # linear_proj input (the context)
        fp8b += q * (1 - lin)
    else:  # fused attention (TE's flash, sdpa's flex): q, k, v, the output and a log-sum-exp per head
        act += q + 2 * kv  # linear_qkv's output, alive through the v view the kernel keeps
        act += q + kv  # q and k after RoPE
        if not selective:
            act += q  # the output; flex lays it out like q, so linear_proj's input is a view of it
            f32 += heads
            if attention_backend == "sdpa" and not cuda_kernels:
                f32 += heads  # the CPU's reference flex also keeps the row maximum of the scores
        if selective or fp8:
            # a tensor of its own: the recomputed output, or TE's FP8 copy. (sdpa's per-sequence fallback,
            # which runs where flex cannot, also keeps its concatenated output: one q more, not counted.)
            act += q * lin
            fp8b += q * (1 - lin)
    if s.experts:
        a, b, c = moe_saved_elements(s, tp, sequence_parallel, etp or tp, fp8, aux_loss)
        return act + a, fp8b + b, f32 + c
    # MLP: linear_fc1's output (gate and up) kept by the fused SwiGLU (bias_activation_fusion; the unfused
    # one would keep 2 x ffn more), linear_fc2's input
    act += 2 * f
    act += f * lin
    fp8b += f * (1 - lin)
    return act, fp8b, f32


def _layer_activation_bytes(s: ModelShape, tp: int, sp: bool, fp8: bool, backend: str, row_tokens: int,
                            recompute: Optional[str], act_bytes: int, cuda_kernels: bool = True,
                            etp: Optional[int] = None, aux_loss: bool = False) -> float:
    act, fp8b, f32 = layer_saved_elements(s, tp, sp, fp8, backend, row_tokens, recompute, cuda_kernels, etp,
                                          aux_loss)
    return act * act_bytes + fp8b + 4 * f32


def logprob_saved_bytes(s: ModelShape, response_tokens: float, act_bytes: int) -> dict[str, float]:
    """What actor.fused_logprobs keeps for backward, by dtype (parameters excluded): the response rows'
    hidden states (activation dtype), the row index of index_select and the local target (int64), the
    log-normaliser and the entropy (fp32) and whether this rank holds the target (bool)."""
    r = float(response_tokens)
    act = "float32" if act_bytes == 4 else "bfloat16"
    out = {"int64": 16 * r, "bool": r}
    out["float32"] = 8 * r + (r * s.hidden * 4 if act == "float32" else 0.0)
    if act != "float32":
        out[act] = r * s.hidden * act_bytes
    return out


def logprob_bytes(s: ModelShape, response_tokens: float, tp: int, act_bytes: int,
                  chunk_bytes: int = LOGPROB_CHUNK_BYTES) -> tuple[float, float]:
    """(saved for backward, backward's peak temporaries) of actor.fused_logprobs for `response_tokens` rows of
    a micro-batch on one tensor-parallel rank. Backward holds the fp32 [V/tp, H] sum of the output weight's
    gradient (and, in bf16, one vocabulary block's product and the cast gradient handed to autograd), one chunk
    of logit rows (recomputed, in the activation dtype, and fp32 probabilities), the response rows' hidden
    gradient and its scatter to every row (index_select's backward)."""
    r, vp, h = float(response_tokens), s.vocab / tp, s.hidden
    saved = sum(logprob_saved_bytes(s, r, act_bytes).values())
    rows = min(r, max(1, chunk_bytes // (4 * max(1, int(vp)))))  # actor.fused_logprobs.chunk_rows
    weight_grad = vp * h * 4 + ((vp + min(vp, LOGPROB_VOCAB_BLOCK)) * h * act_bytes if act_bytes < 4 else 0)
    temps = weight_grad + rows * vp * (4 + act_bytes) + 2 * r * h * act_bytes
    return saved, temps


def estimate_gpu_memory(
    hf_config: dict,
    *,
    micro_batch_tokens: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    data_parallel_size: int = 1,
    use_distributed_optimizer: bool = True,
    params_dtype: str = "bf16",
    fp8: bool = False,
    sequence_parallel: bool = False,
    recompute: Optional[str] = None,
    context_parallel_size: int = 1,
    grad_reduce_in_fp32: bool = True,
    microbatches_in_flight: Optional[int] = None,
    overhead_gb: float = 4.0,
    attention_backend: str = "sdpa",
    pipeline_stage: Optional[int] = None,
    cuda_kernels: bool = True,
    foreach_adam: bool = True,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    moe_aux_loss: bool = False,
    routing_replay: str = "none",
    reference_model: bool = False,
    ref_param_offload: bool = True,
) -> dict[str, float]:
    """Estimated peak memory of one trainer GPU in GiB: weights, grads, optimizer, activations, logits,
    optimizer_step, overhead and total. `micro_batch_tokens` (required: the recipe's train.micro_batch_tokens)
    is the packed token budget of one micro-batch (split across context parallel ranks); `recompute` is Megatron's recompute_granularity (None,
    "selective", "full"); `attention_backend` the resolved backend ("te", "sdpa", "local").
    `microbatches_in_flight` defaults to the pipeline depth (1F1B keeps up to PP micro-batches on stage 0).
    `pipeline_stage` (0 .. PP-1) estimates that stage: its own parameters, PP - stage micro-batches in flight
    (capped by microbatches_in_flight when given), and the output layer and log-probs only on the last stage;
    None (the default) the worst case: the heaviest stage's parameters with stage 0's micro-batches in flight
    and the last stage's extras. `cuda_kernels` (layer_saved_elements): False for what the CPU's kernels save
    (m2po rehearse traces them). `foreach_adam`: torch's foreach AdamW temporary (False: its single-tensor
    kernel, which a CPU runs, makes none worth counting).
    Mixture-of-experts models: a rank holds E / `expert_model_parallel_size` experts, each split over
    `expert_tensor_parallel_size` ranks (None: TP); with the distributed optimizer their optimizer states are
    sharded over expert-data-parallel (TP x CP x DP / (ETP x EP)), the rest over DP x CP. `moe_aux_loss`: the
    load-balancing loss is on (model.moe_aux_loss_coeff > 0); `routing_replay`: algo.routing_replay. The
    activations count the router, the dispatcher and the experts' routed copies (models/moe_memory.py); the
    result then has "expert_params_per_gpu_billion" too.
    `reference_model` (algo.use_kl_loss), `ref_param_offload` (algo.ref_param_offload): the reference model's
    terms and both phases (models/reference_memory.add_reference's keys).
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
    ep, etp = int(expert_model_parallel_size), expert_tensor_parallel_size
    check_expert_layout(s, ep, etp)
    etp = int(etp or tp)
    edp = expert_data_parallel(tp, cp, dp, ep, etp) if s.experts else 1

    if pipeline_stage is not None and not 0 <= pipeline_stage < pp:
        raise ValueError(f"pipeline_stage = {pipeline_stage} must be in [0, {pp})")
    p_rank, p_linear, p_exp = _stage_params(s, tp, pp, pipeline_stage, ep, etp)
    pbytes = BYTES[params_dtype]
    mixed = pbytes < 4
    weights = p_rank * pbytes + (p_linear if fp8 else 0)
    grads = p_rank * (4 if (grad_reduce_in_fp32 or not mixed) else 2)
    opt_bytes = 12 if mixed else 8  # fp32 master + m + v, or m + v when the params are fp32
    shard, eshard = (dp * cp, edp) if use_distributed_optimizer else (1, 1)
    optimizer = (p_rank - p_exp) * opt_bytes / shard + p_exp * opt_bytes / eshard

    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend = {attention_backend!r} must be one of {ATTENTION_BACKENDS}")
    tokens = micro_batch_tokens / cp
    sp_div = tp if sequence_parallel else 1
    per_layer = _layer_activation_bytes(s, tp, sequence_parallel, fp8, attention_backend, int(tokens),
                                        None if recompute == "full" else recompute, pbytes, cuda_kernels, etp,
                                        moe_aux_loss)
    layers_stage = s.layers // pp
    in_flight = microbatches_in_flight if microbatches_in_flight is not None else pp
    if pipeline_stage is not None:
        in_flight = min(in_flight, pp - pipeline_stage)
    last = pipeline_stage is None or pipeline_stage == pp - 1
    if recompute == "full":
        # only each layer's input is kept; one layer's activations are rebuilt at a time
        act = tokens * (layers_stage * in_flight * pbytes * s.hidden / sp_div + per_layer)
    else:
        act = tokens * layers_stage * in_flight * per_layer
    if s.experts:
        # each MoE layer's dispatcher keeps its last micro-batch's routing; one layer's replay targets at a time
        act += tokens * (layers_stage * dispatcher_state_bytes(s, tp, sequence_parallel)
                         + replay_bytes(s, tp, sequence_parallel, routing_replay))
    # outside the layers (last stage, one micro-batch): the final norm's input (its output, the fused log-prob
    # op's input, is kept only at the response rows: counted in logprob_bytes), the token ids, the dense mask
    # of the local backend
    if last:
        act += tokens * (s.hidden * pbytes / sp_div + 4 / sp_div + 8 + (tokens if attention_backend == "local" else 0))
    # the last stage's fused output layer + log-probs (every row counted as a response row: an upper bound)
    logits = sum(logprob_bytes(s, tokens, tp, pbytes)) if last else 0.0
    # torch's foreach AdamW (no TE/Apex): one fp32 temporary per (sharded) parameter during the step
    foreach = foreach_adam and attention_backend != "te"
    step = 4 * (p_rank - p_exp) / shard + 4 * p_exp / eshard if foreach else 0.0

    out = {
        "weights": weights / GiB,
        "grads": grads / GiB,
        "optimizer": optimizer / GiB,
        "activations": act / GiB,
        "logits": logits / GiB,
        "optimizer_step": step / GiB,
        "overhead": float(overhead_gb),
    }
    out["total"] = (out["weights"] + out["grads"] + out["optimizer"] + out["overhead"]
                    + max(out["activations"] + out["logits"], out["optimizer_step"]))
    if reference_model:
        fwd = forward_only_bytes(s, tokens, tp=tp, sequence_parallel=sequence_parallel, act_bytes=pbytes,
                                 attention_backend=attention_backend, cuda_kernels=cuda_kernels,
                                 first=pipeline_stage is None or pipeline_stage == 0, last=last, etp=etp)
        add_reference(out, offload=ref_param_offload, activations_bytes=fwd)
    out["params_per_gpu_billion"] = p_rank / 1e9
    if s.experts:
        out["expert_params_per_gpu_billion"] = p_exp / 1e9
    return out


def format_estimate(est: dict[str, float]) -> str:
    keys = ("weights", "grads", "optimizer", "activations", "logits", "optimizer_step", "overhead")
    return (", ".join(f"{k} {est[k]:.1f}" for k in keys) + format_reference(est)
            + f" -> total {est['total']:.1f} GiB")
