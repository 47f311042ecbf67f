"""HF config -> Megatron TransformerConfig and GPTModel (Transformer Engine spec where TE is usable, else megatron's
local layers with fused SDPA attention; see resolve_attention_backend).

Megatron is imported inside the functions; callers must have initialized Megatron's parallel state
(m2po_megatron.actor.parallel.init_distributed) before building a model."""
from __future__ import annotations

import importlib.util
from typing import Any

from m2po_megatron.infra.device import has_cuda
from m2po_megatron.models.hf_config import HFModelSpec, UnsupportedModelError, read_hf_config
from m2po_megatron.models.layout import validate_layout
from m2po_megatron.models.norm import norms_to_params_dtype, with_local_norms

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
# Minimum CUDA compute capability per recipe (Ada/Hopper for FP8, Blackwell for MX block scaling).
_FP8_MIN_CC = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}


def te_available() -> bool:
    """Transformer Engine usable: importable *and* a CUDA GPU present (it cannot run on CPU)."""
    return has_cuda() and importlib.util.find_spec("transformer_engine") is not None


def _dtype(x):
    import torch

    if x is None or isinstance(x, torch.dtype):
        return x
    names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if x not in names:
        raise ValueError(f"unknown dtype {x!r}; use one of {sorted(names)}")
    return names[x]


def validate_fp8(fp8: str | None, fp8_recipe: str | None, *, cuda: bool | None = None, te: bool | None = None,
                 compute_capability: tuple[int, int] | None = None) -> str | None:
    """The one check of FP8 settings (passed through to Megatron; they need Transformer Engine on a GPU).
    Returns the recipe ("delayed" when fp8 is set without one) or None. Pure when cuda and te are given;
    compute_capability, when known, must reach the recipe's minimum."""
    if fp8 is None:
        if fp8_recipe is not None:
            raise ValueError(f"fp8_recipe={fp8_recipe!r} is set but fp8 is None: set fp8 to one of {FP8_FORMATS}, "
                             "or drop fp8_recipe")
        return None
    if fp8 not in FP8_FORMATS:
        raise ValueError(f"fp8={fp8!r}: use one of {FP8_FORMATS} or None")
    recipe = fp8_recipe or "delayed"
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8_recipe={recipe!r}: use one of {FP8_RECIPES}")
    if not (has_cuda() if cuda is None else cuda):
        raise ValueError("fp8 training needs a CUDA GPU with Transformer Engine; this machine has no GPU "
                         "(drop fp8, or run on an FP8-capable GPU)")
    if not (te_available() if te is None else te):
        raise ValueError("fp8 needs Transformer Engine (pip install transformer-engine[pytorch]); it is not "
                         "importable here")
    need = _FP8_MIN_CC[recipe]
    if compute_capability is not None and tuple(compute_capability) < need:
        raise ValueError(f"fp8_recipe={recipe!r} needs a GPU with compute capability >= {need[0]}.{need[1]}; "
                         f"this one is {compute_capability[0]}.{compute_capability[1]}")
    return recipe


def can_compile(cuda: bool) -> bool:
    """Whether torch.compile (megatron's jit_fuser) can build kernels here: Triton on a GPU, a C++ compiler
    on CPU (inductor's own choice of it). Without one the fused SwiGLU would fail at its first call, so it is
    left off, with a warning, and torch's unfused SwiGLU runs (2 x ffn more saved per token)."""
    if cuda:
        return True
    import shutil
    import warnings

    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        found = shutil.which(get_cpp_compiler()) is not None
    except Exception:  # no compiler inductor accepts (it raises when none is configured or found)
        found = False
    if not found:
        warnings.warn("no C++ compiler for torch.compile on this CPU: megatron's fused SwiGLU is off "
                      "(install g++ to run the same kernels as a GPU)", stacklevel=2)
    return found


def transformer_config_from_hf(hf_config: Any, *, params_dtype=None, tensor_model_parallel_size: int | None = None,
                               pipeline_model_parallel_size: int | None = None,
                               virtual_pipeline_model_parallel_size: int | None = None,
                               context_parallel_size: int | None = None, sequence_parallel: bool = False,
                               pipeline_dtype=None, fp8: str | None = None, fp8_recipe: str | None = None,
                               expert_model_parallel_size: int | None = None,
                               expert_tensor_parallel_size: int | None = None, moe_aux_loss_coeff: float = 0.0,
                               routing_replay: bool = False, moe_grouped_gemm: bool = False, **overrides):
    """Megatron TransformerConfig for a supported HF model.

    hf_config: directory, config.json path, dict, PretrainedConfig or HFModelSpec. Parallel sizes default to
    Megatron's initialized parallel state (or 1). params_dtype defaults to bf16 with CUDA, fp32 on CPU.
    pipeline_dtype defaults to params_dtype. `overrides` are passed to TransformerConfig unchanged (e.g.
    recompute_granularity, hidden_dropout).

    MoE models (Qwen3-MoE): expert sizes default to the parallel state's (or 1, and ETP = TP, megatron-core's
    default); moe_aux_loss_coeff > 0 adds megatron's load-balancing loss; routing_replay builds each router with
    a megatron RouterReplay (record / replay of its top-k, actor/routing_replay.py). moe_grouped_gemm: the local
    layers' experts as one grouped GEMM (models.grouped_experts) where Transformer Engine is not usable; where it is,
    config.moe_grouped_gemm is on anyway and the TE spec's TEGroupedMLP is the grouped path."""
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    spec = hf_config if isinstance(hf_config, HFModelSpec) else read_hf_config(hf_config)
    init = ps.model_parallel_is_initialized()
    tp = tensor_model_parallel_size or (ps.get_tensor_model_parallel_world_size() if init else 1)
    pp = pipeline_model_parallel_size or (ps.get_pipeline_model_parallel_world_size() if init else 1)
    cp = context_parallel_size or (ps.get_context_parallel_world_size() if init else 1)
    if virtual_pipeline_model_parallel_size is None and init:
        virtual_pipeline_model_parallel_size = ps.get_virtual_pipeline_model_parallel_world_size()
    vpp = virtual_pipeline_model_parallel_size if (virtual_pipeline_model_parallel_size or 1) > 1 else None
    ep = expert_model_parallel_size or (ps.get_expert_model_parallel_world_size() if init else 1)
    etp = expert_tensor_parallel_size or (ps.get_expert_tensor_parallel_world_size() if init else None) or tp
    validate_layout(spec, tp, pp, vpp, ep=ep, etp=etp)
    validate_fp8(fp8, fp8_recipe)
    if moe_grouped_gemm and not spec.is_moe:
        raise ValueError(f"moe_grouped_gemm groups a mixture-of-experts model's experts; {spec.architecture} is "
                         "dense: set model.moe_grouped_gemm = false")
    dtype = _dtype(params_dtype) or (torch.bfloat16 if has_cuda() else torch.float32)
    cuda = has_cuda()
    kwargs = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_key_value_heads, kv_channels=spec.head_dim,
        ffn_hidden_size=spec.intermediate_size, gated_linear_unit=True, activation_func=F.silu,
        normalization="RMSNorm", layernorm_epsilon=spec.rms_norm_eps, add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
        sequence_parallel=bool(sequence_parallel and tp > 1), params_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        pipeline_dtype=_dtype(pipeline_dtype) or dtype, fp8=fp8, fp8_recipe=fp8_recipe or "delayed",
        # The same on every device (benchmarks/bench_fusions.py, docs/models.md "Fusions"): megatron's SwiGLU
        # Function (torch.compile'd; saves its input only) pays; bias-dropout-add has nothing to fuse without
        # biases and dropout. Only a machine that cannot compile (a CPU without a C++ compiler) goes without.
        bias_activation_fusion=can_compile(cuda), bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True, use_cpu_initialization=not cuda,
    )
    if spec.is_moe:
        kwargs.update(moe_kwargs(spec, ep=ep, etp=etp, aux_loss_coeff=moe_aux_loss_coeff,
                                 routing_replay=routing_replay,
                                 grouped_gemm=te_available() or bool(moe_grouped_gemm)))
    kwargs.update(overrides)
    if kwargs["fp8"] is None:
        kwargs.pop("fp8_recipe")
    return TransformerConfig(**kwargs)


def moe_kwargs(spec: HFModelSpec, *, ep: int, etp: int, aux_loss_coeff: float = 0.0, routing_replay: bool = False,
               grouped_gemm: bool = False) -> dict:
    """TransformerConfig's MoE fields for a Qwen3-MoE spec. HF's router: softmax over all experts (fp32), top-k,
    then (norm_topk_prob) renormalise the k weights. Megatron's softmax router with pre_softmax=False takes the
    top-k logits and softmaxes them, the same k weights; pre_softmax=True is HF's norm_topk_prob=False."""
    if aux_loss_coeff < 0:
        raise ValueError(f"moe_aux_loss_coeff = {aux_loss_coeff} must be >= 0")
    return dict(
        num_moe_experts=spec.num_experts, moe_router_topk=spec.num_experts_per_tok,
        moe_ffn_hidden_size=spec.moe_intermediate_size, moe_router_score_function="softmax",
        moe_router_pre_softmax=not spec.norm_topk_prob, moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=float(aux_loss_coeff),
        # each token goes to the EP ranks of its experts only (all-to-all, uneven splits: NCCL and gloo alike)
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=grouped_gemm, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        moe_enable_routing_replay=bool(routing_replay),
        # Qwen3-MoE has no capacity limit: every token reaches its k experts (no token dropping)
        moe_expert_capacity_factor=None, moe_permute_fusion=False)


ATTENTION_BACKENDS = ("auto", "te", "sdpa", "local")


def resolve_attention_backend(requested: str | None = "auto", *, cuda: bool | None = None,
                              te: bool | None = None) -> str:
    """The attention backend a model is built with (pure when cuda and te are given):
    "te": Transformer Engine layers (fused attention on THD packed rows, FP8, sequence parallel), GPU only;
    "sdpa": megatron's local layers with models.attention.PackedSDPAttention, any device: one FlexAttention
    call per packed row (document-causal block mask, compiled) on CUDA, else (CPU, no Triton, attention
    dropout) the fallback of one fused SDPA call per packed sequence;
    "local": megatron's own DotProductAttention with a dense block-diagonal mask (stores S x S scores per layer;
    a reference, quadratic in the row length). "auto" (or None) is "te" where TE is usable, else "sdpa".
    Every backend applies RoPE from per-token positions (models.rope)."""
    if cuda is None:
        cuda = has_cuda()
    if te is None:
        te = cuda and importlib.util.find_spec("transformer_engine") is not None
    requested = requested or "auto"
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={requested!r}: use one of {ATTENTION_BACKENDS}")
    if requested == "auto":
        return "te" if (cuda and te) else "sdpa"
    if requested == "te" and not (cuda and te):
        raise ValueError("attention_backend='te' needs Transformer Engine on a CUDA GPU (not usable here); "
                         "use 'sdpa' or 'auto'")
    return requested


def _with_core_attention(layer, core_attention):
    import dataclasses

    attn = layer.submodules.self_attention
    attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, core_attention=core_attention))
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attn))


def layer_spec(spec: HFModelSpec, attention_backend: str | None = None, grouped_experts: bool = False):
    """Megatron layer spec for a resolved attention backend (see resolve_attention_backend). Packed rows
    reach te and sdpa core attention as models.attention.PackedRow. grouped_experts: the local layers' experts as
    models.grouped_experts.GroupedExperts (the TE spec always groups them)."""
    from megatron.core.models.gpt import gpt_layer_specs as s

    from m2po_megatron.models import attention

    backend = resolve_attention_backend(attention_backend)
    experts = spec.num_experts or None
    if backend == "te":
        te = s.get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=bool(experts),
                                                          qk_layernorm=spec.qk_norm)
        return _with_core_attention(te, attention.te_packed_core_attention())
    # megatron's local spec runs experts as a SequentialMLP (one MLP per local expert)
    local = with_local_norms(s.get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=spec.qk_norm,
                                                        normalization="RMSNorm"))  # sequence parallel allowed
    if grouped_experts:
        from m2po_megatron.models.grouped_experts import with_grouped_experts

        local = with_grouped_experts(local)
    if backend == "local":
        return local
    return _with_core_attention(local, attention.PackedSDPAttention)


def _block_spec(layer, config, vp_stage: int | None):
    """The block of `layer`s, as megatron builds it from a layer spec, but whose final norm is the layers' own
    (megatron would take WrappedTorchNorm for the local layers, which refuses sequence parallelism)."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from m2po_megatron.models.norm import LocalNorm

    if layer.submodules.input_layernorm is not LocalNorm:
        return layer  # TE: megatron takes TENorm for the final norm
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage),
                                      layer_norm=LocalNorm)


def build_gpt_model(hf_config: Any, config, *, pre_process: bool | None = None, post_process: bool | None = None,
                    vp_stage: int | None = None, attention_backend: str | None = None,
                    parallel_output: bool = True):
    """One GPTModel (chunk) for this rank. pre_process/post_process default to this rank being the first/last
    pipeline stage (for vp_stage when given). attention_backend: see resolve_attention_backend (default:
    TE where usable, else sdpa). RoPE comes from the position ids given to forward (models.rope).
    Returns the model on the current device."""
    import torch
    from megatron.core import parallel_state as ps

    from m2po_megatron.models.rope import PositionRoPEGPTModel

    spec = hf_config if isinstance(hf_config, HFModelSpec) else read_hf_config(hf_config)
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    rs = spec.rope_scaling
    model = PositionRoPEGPTModel(
        config=config, transformer_layer_spec=_block_spec(layer_spec(
            spec, attention_backend, grouped_experts=bool(config.moe_grouped_gemm) and not te_available()),
            config, vp_stage),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        parallel_output=parallel_output, share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope", rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer()
        else spec.rope_theta, rope_scaling=rs is not None,
        rope_scaling_factor=rs["factor"] if rs else 8.0, vp_stage=vp_stage)
    if rs is not None and hasattr(model, "rotary_pos_emb"):
        # Megatron fixes low/high_freq_factor and the original context length at Llama 3.1's values;
        # recompute with the checkpoint's own values so any llama3-style config matches HF.
        emb = model.rotary_pos_emb
        dim = spec.head_dim
        base = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32,
                                                          device=emb.inv_freq.device) / dim))
        emb.inv_freq = emb._apply_scaling(base, factor=rs["factor"], low_freq_factor=rs["low_freq_factor"],
                                          high_freq_factor=rs["high_freq_factor"],
                                          original_max_position_embeddings=rs["original_max_position_embeddings"])
    norms_to_params_dtype(model, config.params_dtype)  # torch's RMSNorm is built fp32 (models/norm.py)
    if has_cuda():
        model.cuda(torch.cuda.current_device())
    return model


def build_model_chunks(hf_config: Any, config, *, attention_backend: str | None = None) -> list:
    """All model chunks of this rank: one per virtual pipeline stage (a single chunk without VPP)."""
    vpp = config.virtual_pipeline_model_parallel_size
    if not vpp or vpp == 1:
        return [build_gpt_model(hf_config, config, attention_backend=attention_backend)]
    return [build_gpt_model(hf_config, config, vp_stage=i, attention_backend=attention_backend) for i in range(vpp)]


__all__ = ["transformer_config_from_hf", "build_gpt_model", "build_model_chunks", "layer_spec", "te_available",
           "ATTENTION_BACKENDS", "resolve_attention_backend",
           "validate_fp8", "validate_layout", "UnsupportedModelError"]
