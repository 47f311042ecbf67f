"""Grouped experts against megatron's SequentialMLP (issue 51 item 3; models/grouped_experts.py): two layers of
Qwen3-30B-A3B's shape (128 experts, top-8, H 2048, expert FFN 768; the vocabulary too), one packed row of
`tokens` tokens, forward + backward of the logits, on megatron's local layers (sdpa attention, no TE).

Reports each model's tokens/s and the ratio (the goal: grouped >= 3x), and whether the two agree within bf16's
error: both bf16 models' logits against an fp32 SequentialMLP copy of the same weights (grouped's error must not
exceed SequentialMLP's own by more than 10 %), and their max |difference| to each other.

Call `grouped_part(smoke, tokens, reps, deadline)` in its own process (it initializes a one-rank Megatron world);
`python benchmarks/gpu_parts/grouped_part.py [--smoke] [--tokens N]` runs it alone and prints the JSON.
With --smoke (no GPU): the tiny Qwen3-MoE of tests/models, fp32 and bf16 on CPU, where the grouped module runs
its per-expert fallback (torch's grouped kernel is used for bf16 on CUDA only), so only the plumbing is checked."""
from __future__ import annotations

import json
import os
import sys
import time

SMOKE_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32", "attention_dropout": 0.0,
    "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096,
    "intermediate_size": 128}


def _config(smoke: bool) -> dict:
    from pathlib import Path

    import m2po_megatron

    if smoke:
        return dict(SMOKE_MOE)
    path = Path(m2po_megatron.__file__).resolve().parent / "assets/configs/Qwen__Qwen3-30B-A3B-Base/config.json"
    cfg = json.loads(path.read_text())
    cfg["num_hidden_layers"] = 2
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        cfg[k] = None
    return cfg


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def grouped_part(smoke: bool, tokens: int = 16384, reps: int = 5, deadline: float | None = None) -> dict:
    import torch

    from m2po_megatron import models
    from m2po_megatron.actor import parallel
    from m2po_megatron.convert.export import gather_hf_state_dict
    from m2po_megatron.models.grouped_experts import GroupedExperts

    deadline = deadline or time.monotonic() + 300
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    parallel.init_distributed()
    cfg = _config(smoke)
    tokens = min(tokens, 256) if smoke else tokens
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def build(dtype, grouped):
        tc = models.transformer_config_from_hf(cfg, params_dtype=dtype, moe_grouped_gemm=grouped)
        return models.build_gpt_model(cfg, tc, attention_backend="sdpa")

    torch.manual_seed(0)
    seq = build("bf16", False)
    weights = gather_hf_state_dict(seq, cfg)  # fp32 CPU copies under HF names, loaded into the others
    grp = build("bf16", True)
    models.load_hf_weights(grp, weights, cfg)
    experts = type(grp.decoder.layers[0].mlp.experts)
    out = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "tokens": tokens,
           "experts": cfg["num_experts"], "topk": cfg["num_experts_per_tok"], "experts_class": experts.__name__}
    if experts is not GroupedExperts:  # Transformer Engine usable here: the builder keeps TE's own grouped path
        out["error"] = f"grouped model built {experts.__name__} (Transformer Engine usable?), not GroupedExperts"
        return out

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab_size"], (1, tokens), generator=g).to(dev)
    pos = torch.arange(tokens, device=dev).unsqueeze(0)

    def logits(m):
        with torch.no_grad():
            return m(input_ids=ids, position_ids=pos, attention_mask=None).float()

    def step(m):
        m.zero_grad(set_to_none=True)
        m(input_ids=ids, position_ids=pos, attention_mask=None).float().square().mean().backward()

    a, b = logits(seq), logits(grp)
    del weights
    for name, m in (("sequential", seq), ("grouped", grp)):
        step(m)  # warm-up (kernels, allocator)
        _sync()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        n, t0 = 0, time.monotonic()
        while n < max(1, reps):
            step(m)
            _sync()
            n += 1
            if time.monotonic() + (time.monotonic() - t0) / n > deadline:
                break
        sec = (time.monotonic() - t0) / n
        out[name] = {"step_s": round(sec, 4), "tokens_per_s": round(tokens / sec, 1), "steps": n}
        if dev.type == "cuda":
            out[name]["peak_gib"] = round(torch.cuda.max_memory_allocated() / 1024**3, 2)
        m.zero_grad(set_to_none=True)
    out["speedup"] = round(out["grouped"]["tokens_per_s"] / out["sequential"]["tokens_per_s"], 3)

    # bf16's own error: both bf16 models against an fp32 SequentialMLP of the same weights
    ref_model = build("fp32", False)
    models.load_hf_weights(ref_model, gather_hf_state_dict(seq, cfg), cfg)
    del seq, grp
    ref = logits(ref_model)
    err_seq, err_grp = (a - ref).abs(), (b - ref).abs()
    out["max_abs_diff_grouped_vs_sequential"] = round((a - b).abs().max().item(), 5)
    out["mean_abs_err_vs_fp32"] = {"sequential": round(err_seq.mean().item(), 6),
                                   "grouped": round(err_grp.mean().item(), 6)}
    out["max_abs_err_vs_fp32"] = {"sequential": round(err_seq.max().item(), 5),
                                  "grouped": round(err_grp.max().item(), 5)}
    out["within_bf16_error"] = bool(err_grp.mean() <= 1.1 * err_seq.mean() + 1e-6)
    out["goal_3x"] = out["speedup"] >= 3.0
    return out


if __name__ == "__main__":
    import argparse

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="the tiny model on CPU (plumbing only)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop timing steps after this many seconds")
    args = ap.parse_args()
    print(json.dumps(grouped_part(args.smoke, args.tokens, args.reps, time.monotonic() + args.budget_s), indent=2))
