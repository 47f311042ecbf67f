"""Tiny random HF models shrunk from real configs, shared by the model and conversion tests."""
from __future__ import annotations

import json
import pathlib

import m2po_megatron

# The HF configs the package bundles (the recipes' models): every test can read them, no ../shared needed.
CONFIGS = pathlib.Path(m2po_megatron.__file__).resolve().parent / "assets" / "configs"

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=256)

# A small Qwen2 written here.
INLINE_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32", "attention_dropout": 0.0,
    "use_sliding_window": False, **TINY,
}

# A small Qwen3-MoE written here: 4 experts, top-2, every layer sparse.
INLINE_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32", "attention_dropout": 0.0,
    "use_sliding_window": False, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4,
    "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001, **TINY,
}

# name -> (bundled config dir, overrides on top of TINY)
BUNDLED = {
    "qwen2_tied": ("Qwen__Qwen2.5-32B", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen__Qwen3-1.7B-Base", {"head_dim": 32, "tie_word_embeddings": False}),
    "llama32": ("meta-llama__Llama-3.2-3B-Instruct", {"head_dim": 16, "tie_word_embeddings": True,
                                             "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
                                                              "low_freq_factor": 1.0,
                                                              "original_max_position_embeddings": 64,
                                                              "rope_type": "llama3"}}),
}


def tiny_config(name: str, **extra) -> dict:
    if name == "qwen2_untied":
        d = dict(INLINE_QWEN2)
    elif name == "qwen3_moe":
        d = dict(INLINE_QWEN3_MOE)
    else:
        sub, over = BUNDLED[name]
        d = json.loads((CONFIGS / sub / "config.json").read_text())
        d.update(TINY)
        d.update(over)
    d.update(extra)
    d.pop("layer_types", None)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):  # real ids fall outside the tiny vocab
        d[k] = None
    return d


def make_hf_model(cfg: dict, seed: int = 0):
    """A random transformers model in fp32 (eager attention) for a config dict."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    config.architectures = cfg["architectures"]
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          dtype=torch.float32)
    # Random norms (HF initializes them to 1) so a wrong norm mapping cannot pass unnoticed.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            if n.endswith("bias"):
                p.normal_(0, 0.1)
    return model.eval()
