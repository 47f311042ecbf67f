"""Workers of the gpu tests (test_actor_gpu.py), imported by spawned children (no pytest here).

Each runs at the real sizes in bf16 on a GPU and at toy size in fp32 on CPU: the same code, so a GPU run does
not meet their first bug. Rows come from the benchmark's generator (benchmarks/gpu_parts/rows.py: lengths
drawn like the paper's rollouts, packed by the actor's own packer)."""
from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "benchmarks") not in sys.path:
    sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_parts import rows as R  # noqa: E402

CONFIG = REPO / "m2po_megatron" / "assets" / "configs" / "Qwen__Qwen3-1.7B-Base"
TOY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
           vocab_size=512)
RECIPE_ROW = R.RECIPE_ROW


def qwen3(layers: int, toy: bool = False, **over) -> dict:
    """Qwen3-1.7B's shapes (GQA 16/8, head_dim 128, qk-norm, vocab 151936, tied) with fewer layers."""
    cfg = json.loads((CONFIG / "config.json").read_text())
    cfg.update(num_hidden_layers=layers, **(TOY if toy else {}), **over)
    cfg.pop("layer_types", None)
    return cfg


def device_and_precision() -> tuple[str, str]:
    return ("cuda", "bf16") if torch.cuda.is_available() else ("cpu", "fp32")


def hf_model(cfg: dict, dev: str, seed: int = 0):
    """transformers' own random init (std 0.02, unit norms), fp32, eager-free sdpa attention."""
    import transformers

    torch.manual_seed(seed)
    conf = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device(dev):
        return transformers.AutoModelForCausalLM.from_config(conf, attn_implementation="sdpa", dtype=torch.float32)


# ------------------------------------------------------------------------------------------- gradient parity
def diff_norm(a: dict, b: dict) -> float:
    """|| a - b ||_2 over all parameters together (float64), for {hf_name: tensor} with the same names."""
    if a.keys() != b.keys():
        raise ValueError(f"parameter names differ: only in the first {sorted(a.keys() - b.keys())[:5]}, only in "
                         f"the second {sorted(b.keys() - a.keys())[:5]}")
    return math.sqrt(sum(float((a[k].double() - b[k].double()).square().sum()) for k in a))


def norm(a: dict) -> float:
    return math.sqrt(sum(float(v.double().square().sum()) for v in a.values()))


def within_bf16_bound(d_actor: float, d_hf_bf16: float, ref_norm: float, factor: float = 1.5,
                      rel_eps: float = 1e-6) -> bool:
    """The gradient parity rule: the actor's distance from HF fp32 at most `factor` times HF bf16's own
    distance, plus rel_eps x ||g_ref|| (so that two exact fp32 runs pass)."""
    return d_actor <= factor * d_hf_bf16 + rel_eps * ref_norm


def _grpo_inputs(batch, logp_ref):
    """Behaviour log-probs = HF fp32's own (ratios near 1 for every model) for the clip-free grpo_notr loss."""
    batch.behav_log_probs = [x.detach().float().cpu() for x in logp_ref]
    g = torch.Generator().manual_seed(5)
    batch.advantages = torch.randn(len(batch), generator=g)
    return batch


def hf_loss_grads(model, batch) -> tuple[float, dict, list]:
    """grpo_notr token-mean loss of each sequence alone through `model` (log_softmax in fp32), backward;
    returns (loss, {hf_name: fp32 CPU grad}, per-sequence log-probs)."""
    from m2po_megatron.algo import policy_loss

    dev = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    lps = []
    for ids, p in zip(batch.input_ids, batch.prompt_lens):
        ids = ids.to(dev)
        logp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
        lps.append(logp[p - 1:-1].gather(-1, ids[p:, None]).squeeze(-1))
    lp = torch.cat(lps)
    if batch.behav_log_probs is None:
        _grpo_inputs(batch, lps)
    behav = torch.cat(batch.behav_log_probs).to(dev)
    adv = torch.cat([batch.token_advantages(i) for i in range(len(batch))]).to(dev)
    loss, _ = policy_loss("grpo_notr", lp, behav, adv, torch.ones_like(lp, dtype=torch.bool),
                          num_tokens=lp.numel(), num_seqs=len(batch))
    loss.backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}
    return float(loss), grads, [x.detach() for x in lps]


def actor_grads(actor) -> dict:
    """The actor's gradients under HF names: Megatron's fp32 main_grad buffers (TP1, PP1), read after
    train_step (clip_grad=0, so the optimizer leaves them as backward made them)."""
    from m2po_megatron.models.loading import global_named_parameters
    from m2po_megatron.models.weights import rule_for, to_hf

    out = {}
    for chunk in actor.model_chunks():
        for name, p in global_named_parameters(chunk):
            if name == "output_layer.weight" and actor.spec.tie_word_embeddings:
                continue
            rule, layer = rule_for(actor.spec, name)
            for hf_name, t in to_hf(actor.spec, rule, [p.main_grad.detach()], layer):
                out[hf_name] = t.float().cpu().clone()
    return out


def grad_worker(backend: str, toy: bool = False) -> dict:
    """Gradients of one grpo_notr step on 6 rollout-like sequences: the actor (bf16 on a GPU) and HF bf16,
    both against HF fp32 on the same weights, as norms over all parameters."""
    from m2po_megatron.actor.actor import MegatronActor

    dev, precision = device_and_precision()
    cfg = qwen3(4, toy)
    hf = hf_model(cfg, dev)
    n = 256 if toy else 1024
    batch = R.make_batch(R.draw_lengths(6, seed=3, max_len=n, scale=n / RECIPE_ROW * 4), cfg["vocab_size"], seed=3)
    batch.behav_log_probs = batch.advantages = None
    loss_ref, g_ref, _ = hf_loss_grads(hf, batch)
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    loss16, g16, _ = hf_loss_grads(hf16, batch)
    del hf16
    actor = MegatronActor(hf_config=cfg, load_from=hf, params_dtype=precision, micro_batch_tokens=n,
                          attention_backend=backend, loss_name="grpo_notr", clip_grad=0.0, lr=1e-7, seed=0)
    m = actor.train_step(batch)
    g_actor = actor_grads(actor)
    actor.close()
    return {"loss_ref": loss_ref, "loss_hf_bf16": loss16, "loss_actor": m["loss"], "ref_norm": norm(g_ref),
            "d_actor": diff_norm(g_actor, g_ref), "d_hf_bf16": diff_norm(g16, g_ref),
            "max_abs_actor": max(float((g_actor[k] - g_ref[k]).abs().max()) for k in g_ref),
            "max_abs_hf_bf16": max(float((g16[k] - g_ref[k]).abs().max()) for k in g_ref)}


# ------------------------------------------------------------------------------------------------- resume
def resume_worker(backend: str, tmp: str, toy: bool = False) -> dict:
    """Two updates, save, a third update (uninterrupted); a fresh actor with other initial weights loads the
    checkpoint and makes the third update. Adam (torch's AdamW where TE/Apex are absent), distributed optimizer."""
    import gc

    from m2po_megatron.actor.actor import MegatronActor
    from m2po_megatron.convert.export import gather_hf_state_dict

    dev, precision = device_and_precision()
    cfg = qwen3(2, toy, **({} if toy else {"vocab_size": 16384}))
    row = 256 if toy else 4096
    batches = [R.rollout_batch(2, row, cfg["vocab_size"], seed=s, scale=row / RECIPE_ROW) for s in (11, 12, 13)]
    kw = dict(hf_config=cfg, params_dtype=precision, micro_batch_tokens=row, attention_backend=backend,
              loss_name="m2po", lr=1e-3, use_distributed_optimizer=True)
    a = MegatronActor(**kw, seed=0)
    a.train_step(batches[0])
    a.train_step(batches[1])
    a.save(tmp)
    w_saved = gather_hf_state_dict(a.model_chunks(), a.spec)
    m_cont = a.train_step(batches[2])
    w_cont = gather_hf_state_dict(a.model_chunks(), a.spec)
    updates_cont = a.updates_applied
    a.close()
    del a
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    b = MegatronActor(**kw, seed=1)
    w_fresh = gather_hf_state_dict(b.model_chunks(), b.spec)
    b.load(tmp)
    w_loaded = gather_hf_state_dict(b.model_chunks(), b.spec)
    m_res = b.train_step(batches[2])
    w_res = gather_hf_state_dict(b.model_chunks(), b.spec)
    updates_res = b.updates_applied
    b.close()
    return {"loss_cont": m_cont["loss"], "loss_res": m_res["loss"], "grad_norm_cont": m_cont["grad_norm"],
            "grad_norm_res": m_res["grad_norm"], "fresh_vs_saved": diff_norm(w_fresh, w_saved),
            "loaded_vs_saved_max": max(float((w_loaded[k] - w_saved[k]).abs().max()) for k in w_saved),
            "update_norm": diff_norm(w_cont, w_saved), "resumed_vs_cont": diff_norm(w_res, w_cont),
            "updates": (updates_cont, updates_res)}


# ------------------------------------------------------------------------------------------ peak memory
def peak_worker(backend: str, fp8, toy: bool = False) -> dict:
    """Two train steps on 2 packed rows of the recipes' 16,384 tokens (rollout-like lengths; ragged, no row a
    multiple of 16, for TE) of an 8-layer Qwen3-1.7B; the allocator's peak of the second step against
    estimate_gpu_memory's tensor terms at the longest row."""
    from m2po_megatron.actor.actor import MegatronActor
    from m2po_megatron.actor.packing import plan_microbatches
    from m2po_megatron.models.memory import estimate_gpu_memory

    dev, precision = device_and_precision()
    cfg = qwen3(8, toy)
    row = 1024 if toy else RECIPE_ROW
    batch = R.rollout_batch(2, row, cfg["vocab_size"], seed=0, scale=row / RECIPE_ROW,
                            ragged_multiple=16 if backend == "te" else None)
    lengths = [m.seq_len for m in plan_microbatches(batch, list(range(len(batch))), row)]
    actor = MegatronActor(hf_config=cfg, params_dtype=precision, micro_batch_tokens=row, attention_backend=backend,
                          fp8=fp8, fp8_recipe="tensorwise" if fp8 else None, lr=1e-5, loss_name="m2po", seed=0)
    actor.train_step(batch)  # allocates the optimizer state
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    m = actor.train_step(batch)
    est = estimate_gpu_memory(cfg, micro_batch_tokens=max(lengths), params_dtype=precision, fp8=bool(fp8),
                              attention_backend=actor.attention_backend)
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else float("nan")
    actor.close()
    return {"loss": m["loss"], "grad_norm": m["grad_norm"], "microbatches": m["num_microbatches"],
            "row_lengths": lengths, "peak": peak, "estimate": (est["total"] - est["overhead"]) * 1024**3}


# ------------------------------------------------------------------------------------------- mixture of experts
MOE_CONFIG = REPO / "m2po_megatron" / "assets" / "configs" / "Qwen__Qwen3-30B-A3B-Base"
MOE_TOY = dict(TOY, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


def qwen3_moe(layers: int, toy: bool = False) -> dict:
    """Qwen3-30B-A3B's shapes (128 experts of 768, top-8, GQA 32/4, head_dim 128, vocab 151936) with fewer layers."""
    cfg = json.loads((MOE_CONFIG / "config.json").read_text())
    cfg.update(num_hidden_layers=layers, **(MOE_TOY if toy else {}))
    cfg.pop("num_local_experts", None)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        cfg[k] = None
    return cfg


def moe_worker(backend: str, toy: bool = False) -> dict:
    """The real-size MoE path on one GPU (2 layers of Qwen3-30B-A3B, bf16; grouped experts on TE): log-probs
    against HF fp32 beside HF bf16's own error, then one R3 update with full recompute whose routers dispatch
    to the replayed experts for every replayed token in the forward and in the recompute (router hooks)."""
    import actor_workers as w

    from m2po_megatron.actor.actor import MegatronActor

    dev, precision = device_and_precision()
    cfg = qwen3_moe(2, toy)
    hf = hf_model(cfg, dev)
    batch = w.make_batch(n=6, vocab=cfg["vocab_size"], min_len=8 if toy else 64, max_len=40 if toy else 512)
    ref, _ = w.hf_log_probs(hf, batch)
    actor = MegatronActor(hf_config=cfg, load_from=hf, params_dtype=precision, micro_batch_tokens=1024,
                          attention_backend=backend, loss_name="grpo", routing_replay="r3",
                          recompute_granularity="full", use_distributed_optimizer=False, optimizer="sgd", lr=1e-3)
    lp, _ = actor.compute_log_probs(batch)
    hf16, _ = w.hf_log_probs(copy.deepcopy(hf).to(torch.bfloat16), batch) if dev == "cuda" else (ref, None)
    d_actor = torch.cat([(a - b).abs() for a, b in zip(lp, ref)])
    d_hf = torch.cat([(a - b).abs() for a, b in zip(hf16, ref)])
    g = torch.Generator().manual_seed(5)
    L, E, k = cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_tok"]
    batch.behav_log_probs = [x.clone() for x in ref]
    batch.advantages = torch.randn(len(batch), generator=g)
    batch.routed_experts = [torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(ids.numel() * L)])
                            .view(-1, L, k).to(torch.int16) for ids in batch.input_ids]
    seen: dict = {}
    handles = w._router_hooks(actor, seen)
    m = actor.train_step(batch)
    for h in handles:
        h.remove()
    exact = w._replay_exact(actor, batch, seen, k)
    actor.close()
    return {"actor_mean": float(d_actor.mean()), "hf_mean": float(d_hf.mean()), "actor_max": float(d_actor.max()),
            "loss": m["loss"], "grad_norm": m["grad_norm"], "exact": exact,
            "replayed": (m["routing/replayed_tokens"], m["routing/replayed_tokens_recompute"]),
            "mismatch": m["routing/mismatch"]}
