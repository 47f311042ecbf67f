"""Reading a Hugging Face causal-LM config into the few facts the Megatron side needs (pure Python).

Supported: Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`), Qwen3 (`Qwen3ForCausalLM`, q/k RMSNorm, head_dim may differ
from hidden/heads), Qwen3-MoE (`Qwen3MoeForCausalLM`: every layer's MLP a top-k router over SwiGLU experts, no
shared expert), Llama 3 / 3.1 / 3.2 (`LlamaForCausalLM`, optional `llama3` RoPE scaling); tied or untied
embeddings; grouped-query attention. Anything else raises UnsupportedModelError listing what is supported."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "LlamaForCausalLM": "llama",
}
SUPPORTED_MODEL_TYPES = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "llama": "llama"}


class UnsupportedModelError(ValueError):
    """The HF config describes a model this project cannot map to Megatron."""


def supported_text() -> str:
    return ("supported: Qwen2/Qwen2.5 (Qwen2ForCausalLM), Qwen3 (Qwen3ForCausalLM), Qwen3-MoE "
            "(Qwen3MoeForCausalLM, every layer sparse), Llama 3/3.1/3.2 (LlamaForCausalLM, rope_type default or "
            "llama3); SiLU-gated MLP, RMSNorm")


@dataclasses.dataclass(frozen=True)
class HFModelSpec:
    """The HF facts that decide the Megatron architecture and the weight layout."""

    family: str  # 'qwen2' | 'qwen3' | 'qwen3_moe' | 'llama'
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    # llama3 RoPE scaling parameters, or None for plain RoPE
    rope_scaling: Mapping[str, float] | None = None
    # Mixture of experts (0 experts: a dense model). Every layer's MLP is `num_experts` SwiGLU experts of
    # `moe_intermediate_size`, `num_experts_per_tok` chosen per token by a linear router: softmax over all
    # experts, top-k, and (norm_topk_prob) the k weights renormalised to sum to 1.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0

    @property
    def queries_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def load_hf_config_dict(source: Any) -> dict:
    """A dict from: a model directory, a config.json path, a dict, or a transformers PretrainedConfig."""
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"HF config not found: {path} (expected a model directory with config.json)")
        with open(path) as f:
            return json.load(f)
    if hasattr(source, "to_dict"):
        d = source.to_dict()
        # transformers 5 keeps rope settings in rope_parameters; to_dict() includes them.
        return d
    raise TypeError(f"cannot read an HF config from {type(source).__name__}; pass a directory, dict or PretrainedConfig")


def _rope(d: dict) -> tuple[float, dict | None]:
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    theta = d.get("rope_theta", None)
    if theta is None:
        theta = params.get("rope_theta", scaling.get("rope_theta", 10000.0))
    rope_type = (params.get("rope_type") or params.get("type") or scaling.get("rope_type")
                 or scaling.get("type") or "default")
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported (only default and llama3); "
                                    + supported_text())
    src = scaling if scaling.get("rope_type", scaling.get("type")) == "llama3" else params
    try:
        rs = {k: float(src[k]) for k in ("factor", "low_freq_factor", "high_freq_factor",
                                           "original_max_position_embeddings")}
    except KeyError as e:
        raise UnsupportedModelError(f"llama3 rope scaling is missing {e.args[0]!r}") from None
    return float(theta), rs


def read_hf_config(source: Any) -> HFModelSpec:
    """Parse and validate an HF config (directory, config.json, dict or PretrainedConfig)."""
    d = load_hf_config_dict(source)
    archs = d.get("architectures") or []
    family = None
    arch = None
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            family, arch = SUPPORTED_ARCHITECTURES[a], a
            break
    if family is None and not archs and d.get("model_type") in SUPPORTED_MODEL_TYPES:
        family = SUPPORTED_MODEL_TYPES[d["model_type"]]
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[family]
    if family is None:
        raise UnsupportedModelError(
            f"unsupported architecture {archs or d.get('model_type')!r}; " + supported_text())

    def need(key):
        if d.get(key) is None:
            raise UnsupportedModelError(f"HF config field {key!r} is missing")
        return d[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv = int(d.get("num_key_value_heads") or heads)
    head_dim = d.get("head_dim") or hidden // heads
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu); " + supported_text())
    if heads % kv:
        raise UnsupportedModelError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    moe = _moe(d) if family == "qwen3_moe" else {}
    if not moe and (d.get("num_experts") or d.get("num_local_experts")):
        raise UnsupportedModelError(f"mixture-of-experts {arch} is not supported; " + supported_text())
    if d.get("use_sliding_window"):
        raise UnsupportedModelError("use_sliding_window=true is not supported (Megatron local attention is global)")
    if d.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported")
    theta, rope_scaling = _rope(d)
    if family == "qwen2":
        qkv_bias = True
    else:
        qkv_bias = bool(d.get("attention_bias", False))
    return HFModelSpec(
        family=family, architecture=arch, vocab_size=int(need("vocab_size")), hidden_size=hidden,
        num_layers=int(need("num_hidden_layers")), num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=int(head_dim), intermediate_size=int(need("intermediate_size")),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), qkv_bias=qkv_bias,
        qk_norm=family in ("qwen3", "qwen3_moe"), rope_scaling=rope_scaling, **moe)


def _moe(d: dict) -> dict:
    """The MoE fields of a Qwen3-MoE config, checked: every layer sparse, top-k within the experts."""
    def need(key):
        if d.get(key) is None:
            raise UnsupportedModelError(f"HF config field {key!r} is missing (needed by Qwen3MoeForCausalLM)")
        return int(d[key])

    if d.get("num_experts") is None and d.get("num_local_experts") is not None:
        d = {**d, "num_experts": d["num_local_experts"]}  # transformers 5 saves Qwen3-MoE's num_experts so
    n, k, ffn = need("num_experts"), need("num_experts_per_tok"), need("moe_intermediate_size")
    if not 1 <= k <= n:
        raise UnsupportedModelError(f"num_experts_per_tok = {k} must be between 1 and num_experts = {n}")
    if d.get("mlp_only_layers"):
        raise UnsupportedModelError(f"mlp_only_layers = {d['mlp_only_layers']}: dense layers inside a Qwen3-MoE "
                                    "model are not supported (every layer must be sparse); use []")
    if int(d.get("decoder_sparse_step", 1)) != 1:
        raise UnsupportedModelError(f"decoder_sparse_step = {d['decoder_sparse_step']} is not supported "
                                    "(every layer must be sparse); use 1")
    if d.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError("shared experts (shared_expert_intermediate_size) are not supported")
    return dict(num_experts=n, num_experts_per_tok=k, moe_intermediate_size=ffn,
                norm_topk_prob=bool(d.get("norm_topk_prob", True)),
                router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.0) or 0.0))
