"""The engine check's model: a tiny random Qwen3 written as an HF directory (transformers' own save), and
weights that make its greedy output known in advance. With every layer's output projections (o_proj,
down_proj) zero, the residual stream is the token's embedding; with every embedding row the same positive
vector and the final norm's weight one, the normed hidden state is all ones; with lm_head zero except row
`token`, that token's logit is the hidden size and every other logit zero, so greedy decoding repeats `token`.
Sizes that SGLang's attention kernels serve (head_dim 64)."""
from __future__ import annotations

from pathlib import Path

CONFIG = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=256, intermediate_size=512,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512,
              max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
              hidden_act="silu", attention_bias=False)


def build(directory: Path, dtype: str = "float32") -> Path:
    """Write the tiny model (seed 0) to `directory` unless it is there; returns the directory."""
    import torch
    import transformers

    directory = Path(directory)
    if (directory / "config.json").is_file() and any(directory.glob("*.safetensors")):
        return directory
    torch.manual_seed(0)
    conf = transformers.AutoConfig.for_model(**{k: v for k, v in CONFIG.items() if k != "architectures"},
                                             architectures=CONFIG["architectures"])
    model = transformers.AutoModelForCausalLM.from_config(conf, dtype=getattr(torch, dtype))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def marked_weights(directory: Path, token: int) -> list[tuple[str, "object"]]:
    """Every tensor of the model at `directory`, changed so that greedy decoding repeats `token` (above)."""
    import torch
    from safetensors.torch import load_file

    named = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        named.update(load_file(str(f)))
    out = []
    for name, t in sorted(named.items()):
        if name == "model.embed_tokens.weight":
            t = torch.full_like(t, 0.5)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            t = torch.zeros_like(t)
        elif name == "model.norm.weight":
            t = torch.ones_like(t)
        elif name == "lm_head.weight":
            t = torch.zeros_like(t)
            t[token] = 1.0
        out.append((name, t.contiguous()))
    return out
