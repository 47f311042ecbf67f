"""The HF peer's part: plain transformers doing the actor's train_step work on the same tokens
(benchmarks/hf_peer.py), padded micro-batches of the same token budget."""
from __future__ import annotations

import time

from gpu_parts import mfu
from gpu_parts.common import cuda, gib, hf_model, model_config, time_steps
from gpu_parts.profile_part import LOGPROBS, OPTIMIZER, profile_in_budget


def hf_part(model_name: str, smoke: bool, rows: int, row_tokens: int, reps: int, recompute: str | None = None,
            legacy_seqs: int = 0, budget_s: float = 60.0, profile_dir: str | None = None,
            profile_name: str = "hf") -> dict:
    """The same batch as actor_part with the same arguments (same generator, same seed); its model FLOPs
    counted on the real tokens, as the actor's (padding is not model work); `profile_dir` as actor_part's."""
    import torch

    from gpu_parts import rows as R
    from hf_peer import PRECISION, HFPeer

    if recompute not in (None, "full"):
        raise ValueError(f"recompute={recompute!r}: the HF peer recomputes whole layers ('full') or nothing")
    deadline = time.monotonic() + budget_s - 5
    on_gpu = cuda()
    dev = torch.device("cuda" if on_gpu else "cpu")
    cfg = model_config(model_name, smoke)
    if legacy_seqs:
        batch = R.legacy_batch(legacy_seqs, cfg["vocab_size"], row_tokens)
    else:
        batch = R.rollout_batch(rows, row_tokens, cfg["vocab_size"], seed=0, scale=row_tokens / R.RECIPE_ROW)
    model = hf_model(cfg, dev, torch.bfloat16 if on_gpu else torch.float32)
    peer = HFPeer(model, batch, row_tokens, recompute=recompute == "full")
    dt, done, m, first = time_steps(peer.step, reps, deadline)
    tokens = sum(batch.lengths)
    out = {"tokens": tokens, "padded_tokens": peer.padded_tokens, "microbatches": m["num_microbatches"],
           "step_s": round(dt, 3), "first_step_s": round(first, 2), "timed_steps": done,
           "tokens_per_s": round(tokens / dt, 1), "loss": m["loss"],
           "grad_norm": m["grad_norm"], "recompute": recompute, "precision": PRECISION,
           "compute_dtype": str(next(model.parameters()).dtype), **mfu.model_flops(cfg, batch.lengths),
           "logprob_pass": True}  # the M2PO mask's no-grad forward (hf_peer.HFPeer.step)
    if on_gpu:
        out["peak_allocated_gib"] = gib(torch.cuda.max_memory_allocated())
    if profile_dir is not None:
        out["profile"] = profile_in_budget(peer.step, dt, deadline, profile_dir, profile_name,
                                           [(peer.opt, "step", OPTIMIZER), (model.lm_head, "forward", LOGPROBS)])
    return out
