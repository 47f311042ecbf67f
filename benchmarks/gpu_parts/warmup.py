"""The warm-up part: every kernel the actor parts compile, compiled once before they run, on their own shapes.

A cold compile happens in a part's first (untimed) step, inside the part's budget: FlexAttention forward and
backward (Triton, through inductor), megatron's fused SwiGLU (jit_fuser = torch.compile) and the other inductor
graphs of the step. This part builds each actor part's MegatronActor with the same arguments
(actor_part.actor_kwargs: dtype, attention backend, recompute) and runs the same calls on the same rows
(actor_part.part_batch, parity_batch): the parity part's log-prob pass, then one train_step of the part's
mini-batch. So every graph a part asks for has the key of a graph compiled here:

- flex is compiled with dynamic shapes (models.attention._compiled_flex);
- SwiGLU is not (torch.compile's default): its first row compiles a graph for that row's length, the next
  length recompiles with that dimension dynamic (dynamo's automatic dynamic shapes). The same rows in the same
  order give the same graphs, and gpu_check also sets TORCH_COMPILE_JOB_ID, which makes dynamo keep the
  "this dimension changes" profile on disk (its local PGO), so a later process compiles the dynamic graph first.

Inductor keeps what it compiled in its on-disk caches (FX graph cache, AOTAutograd cache, Triton's kernels under
TORCHINDUCTOR_CACHE_DIR, which gpu_check sets once for all parts), so the later parts' processes load the kernels
instead of compiling them. A warm-up cut short at its budget still leaves what it finished in the cache.
Reports the seconds of each call; a second train_step (all graphs compiled) when the budget leaves room, so
compile_s = first - second.
"""
from __future__ import annotations

import time

from gpu_parts.common import cuda, model_config, sync

ACTOR_ARGS = ("model_name", "smoke", "rows", "row_tokens", "recompute", "parity", "attention_backend", "fp8",
              "ragged", "legacy_seqs")


def warmup_part(specs: list[dict], budget_s: float = 60.0) -> dict:
    """specs: the actor parts' keyword arguments (actor_part's; the timing ones are ignored), in run order."""
    import torch

    from gpu_parts.actor_part import actor_kwargs, parity_batch, part_batch
    from m2po_megatron.actor.actor import MegatronActor

    t_end = time.monotonic() + budget_s - 5
    on_gpu = cuda()
    out: dict = {"parts": []}
    for spec in specs:
        s = {k: spec[k] for k in ACTOR_ARGS if k in spec}
        rec: dict = {"model": s["model_name"], "row_tokens": s["row_tokens"], "recompute": s.get("recompute")}
        out["parts"].append(rec)
        if time.monotonic() > t_end:
            rec["skipped"] = "no time left"
            continue
        cfg = model_config(s["model_name"], s["smoke"])
        batch = part_batch(cfg, s.get("rows", 0), s["row_tokens"], s.get("legacy_seqs", 0), s.get("ragged", False))
        t0 = time.monotonic()
        actor = MegatronActor(**actor_kwargs(cfg, "bf16" if on_gpu else "fp32", s["row_tokens"], s.get("recompute"),
                                             s.get("attention_backend", "auto"), s.get("fp8")))
        rec["build_s"] = round(time.monotonic() - t0, 2)
        rec["attention_backend"] = actor.attention_backend
        if s.get("parity"):
            t0 = time.monotonic()
            actor.compute_log_probs(parity_batch(cfg, s["row_tokens"]))
            sync()
            rec["parity_log_probs_s"] = round(time.monotonic() - t0, 2)
        t0 = time.monotonic()
        actor.train_step(batch)
        sync()
        rec["first_step_s"] = round(time.monotonic() - t0, 2)
        if time.monotonic() + rec["first_step_s"] / 2 < t_end:  # a second step costs far less than the first
            t0 = time.monotonic()
            actor.train_step(batch)
            sync()
            rec["second_step_s"] = round(time.monotonic() - t0, 2)
            rec["compile_s"] = round(rec["first_step_s"] - rec["second_step_s"], 2)
        actor.close()
        del actor
        if on_gpu:
            torch.cuda.empty_cache()
    return out
