"""The actor's part: MegatronActor.train_step tokens/s on the recipes' rows, peak memory against
estimate_gpu_memory, the batch's model FLOPs (gpu_parts/mfu.py), host syncs per step at 1 and at N
micro-batches, (optionally) log-prob parity against HF fp32 next to HF bf16's own error and one profiled step."""
from __future__ import annotations

import math
import sys
import time

from gpu_parts import mfu
from gpu_parts.common import count_syncs, cuda, gib, hf_model, model_config, sync, time_steps
from gpu_parts.profile_part import LOGPROBS, OPTIMIZER, profile_in_budget


def actor_part(model_name: str, smoke: bool, rows: int, row_tokens: int, reps: int, parity: bool = False,
               recompute: str | None = None, attention_backend: str = "auto", fp8: str | None = None,
               ragged: bool = False, legacy_seqs: int = 0, budget_s: float = 60.0,
               profile_dir: str | None = None, profile_name: str = "actor") -> dict:
    """`rows` packed rows of `row_tokens` drawn like the paper's rollouts (gpu_parts.rows; `ragged`: no row a
    multiple of 16), or the earlier batch of `legacy_seqs` sequences (the 4,096-token comparison). With
    `profile_dir`, one more step under torch.profiler (gpu_parts/profile_part.py), its trace there."""
    import torch

    from m2po_megatron.actor.actor import MegatronActor
    from m2po_megatron.actor.packing import plan_microbatches
    from m2po_megatron.models.memory import estimate_gpu_memory

    deadline = time.monotonic() + budget_s - 5
    on_gpu = cuda()
    dev = torch.device("cuda" if on_gpu else "cpu")
    cfg = model_config(model_name, smoke)
    batch = part_batch(cfg, rows, row_tokens, legacy_seqs, ragged)
    plan = plan_microbatches(batch, list(range(len(batch))), row_tokens)
    out: dict = {"model": "tiny" if smoke else model_name, "tokens": sum(batch.lengths), "seqs": len(batch),
                 "micro_batch_tokens": row_tokens, "microbatches": len(plan),
                 "row_lengths": [m.seq_len for m in plan], "recompute": recompute}
    if ragged:
        out["rows_multiple_of_16"] = sum(1 for m in plan if m.seq_len % 16 == 0)
    precision = "bf16" if on_gpu else "fp32"
    kw = actor_kwargs(cfg, precision, row_tokens, recompute, attention_backend, fp8)
    if parity:
        out["parity"], actor = _parity(cfg, kw, dev)
    else:
        actor = MegatronActor(**kw)
    out["attention_backend"] = actor.attention_backend
    out.update(mfu.model_flops(cfg, batch.lengths))  # gpu_check adds the MFU: it knows the device's peak
    out["logprob_pass"] = actor.loss_name == "m2po" and actor.m2po_scope == "global"  # the M2PO mask's forward
    dt, done, m, first = time_steps(lambda: actor.train_step(batch), reps, deadline)
    out.update(step_s=round(dt, 3), first_step_s=round(first, 2), timed_steps=done,
               tokens_per_s=round(out["tokens"] / dt, 1), loss=m["loss"],
               grad_norm=m["grad_norm"], finite=bool(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])))
    est = estimate_gpu_memory(cfg, micro_batch_tokens=max(out["row_lengths"]), params_dtype=precision,
                              fp8=bool(fp8), attention_backend=actor.attention_backend, recompute=recompute)
    out["estimate_gib"] = {k: round(v, 2) for k, v in est.items()}
    if on_gpu:
        peak = torch.cuda.max_memory_allocated()
        tensors = (est["total"] - est["overhead"]) * 1024**3
        out.update(peak_allocated_gib=gib(peak), peak_reserved_gib=gib(torch.cuda.max_memory_reserved()),
                   estimate_tensors_gib=gib(tensors), peak_over_estimate=round(peak / tensors, 3))
    if profile_dir is not None:  # ranges around the optimizer's step and the output layer's log-prob function
        wraps = [(actor.optimizer, "step", OPTIMIZER),
                 (sys.modules[MegatronActor.__module__], "output_layer_log_probs", LOGPROBS)]
        out["profile"] = profile_in_budget(lambda: actor.train_step(batch), dt, deadline, profile_dir, profile_name,
                                           wraps)
    # host syncs of one train_step with every micro-batch, and with the first row's sequences alone: a count
    # that grows with the micro-batches is a sync inside the micro-batch loop
    if time.monotonic() + 1.5 * dt < deadline:
        out["syncs"] = {"microbatches": len(plan), **count_syncs(lambda: actor.train_step(batch))}
        one = batch.select(plan[0].seq_index)
        if time.monotonic() + dt < deadline and len(plan) > 1:
            out["syncs_one_microbatch"] = count_syncs(lambda: actor.train_step(one))
    else:
        out["syncs"] = {"count": None, "why": "no time left in the part's budget"}
    actor.close()
    return out


def part_batch(cfg: dict, rows: int, row_tokens: int, legacy_seqs: int = 0, ragged: bool = False):
    """The part's mini-batch: `rows` packed rollout-like rows (seed 0), or the earlier `legacy_seqs` batch. The
    warm-up (gpu_parts/warmup.py) compiles on exactly these rows, so the parts' graphs are in the cache."""
    from gpu_parts import rows as R

    if legacy_seqs:
        return R.legacy_batch(legacy_seqs, cfg["vocab_size"], row_tokens)
    return R.rollout_batch(rows, row_tokens, cfg["vocab_size"], seed=0, scale=row_tokens / R.RECIPE_ROW,
                           ragged_multiple=16 if ragged else None)


def parity_batch(cfg: dict, row_tokens: int):
    """The 8 rollout-like sequences of the log-prob parity check (at most 1,024 tokens each)."""
    from gpu_parts import rows as R

    n = min(1024, row_tokens)
    return R.make_batch(R.draw_lengths(8, seed=1, max_len=n, response_range=(min(200, n // 2), n)),
                        cfg["vocab_size"], seed=1)


def actor_kwargs(cfg: dict, precision: str, row_tokens: int, recompute: str | None = None,
                 attention_backend: str = "auto", fp8: str | None = None) -> dict:
    """MegatronActor's arguments in the actor parts (and the warm-up's: the same kernels get compiled)."""
    return dict(hf_config=cfg, params_dtype=precision, micro_batch_tokens=row_tokens, lr=1e-6, loss_name="m2po",
                attention_backend=attention_backend, fp8=fp8, fp8_recipe="tensorwise" if fp8 else None, seed=0,
                recompute_granularity=recompute)


def _parity(cfg: dict, actor_kw: dict, dev):
    """Mean and max |log p - log p_HF fp32| over the response tokens of 8 rollout-like sequences for the actor
    (built from the HF weights; bf16 on a GPU) and for HF itself in bf16. Returns (numbers, actor)."""
    import torch

    from m2po_megatron.actor.actor import MegatronActor

    hf = hf_model(cfg, dev, torch.float32).eval()
    batch = parity_batch(cfg, actor_kw["micro_batch_tokens"])

    @torch.no_grad()
    def hf_lp(model):
        res = []
        for ids, p in zip(batch.input_ids, batch.prompt_lens):
            ids = ids.to(dev)
            logp = torch.log_softmax(model(ids[None]).logits[0].float(), -1)
            res.append(logp[p - 1:-1].gather(-1, ids[p:, None]).squeeze(-1).cpu())
        return torch.cat(res)

    ref = hf_lp(hf)
    actor = MegatronActor(load_from=hf, **actor_kw)
    lp, _ = actor.compute_log_probs(batch)
    hf16 = hf_lp(hf.to(torch.bfloat16))
    del hf
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    sync()
    d_actor, d_hf = (torch.cat(lp) - ref).abs(), (hf16 - ref).abs()
    return ({"tokens": int(ref.numel()), "actor_max_abs": float(d_actor.max()),
             "actor_mean_abs": float(d_actor.mean()), "hf_bf16_max_abs": float(d_hf.max()),
             "hf_bf16_mean_abs": float(d_hf.mean())}, actor)

