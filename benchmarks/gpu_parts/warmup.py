"""The warm-up part: every kernel the later parts compile, compiled once before they run.

A cold compile happens in a part's first (untimed) step, inside the part's budget: FlexAttention forward and
backward (Triton, through inductor), megatron's fused SwiGLU (torch.compile) and the other inductor graphs of the
step. This part runs one train_step of each model the actor parts use, with the same dtype, attention backend,
heads and recompute setting, on short rows: FlexAttention is compiled with dynamic shapes
(models.attention._compiled_flex), so a 2,048-token row compiles the graph that 16,384-token rows then use.
Inductor keeps what it compiled in its on-disk caches (the FX graph cache and Triton's kernel cache under
TORCHINDUCTOR_CACHE_DIR, which gpu_check sets once for all parts), so the later parts' processes load the kernels
instead of compiling them. Reports the seconds of each model's first step (the compile) and of a second one.
"""
from __future__ import annotations

import time

from gpu_parts.common import cuda, model_config, sync

ROW = 2048


def warmup_part(models: list[tuple[str, str | None]], smoke: bool, budget_s: float = 60.0) -> dict:
    """One step per (model name, recompute) of `models`, then a second: {model: {first_s, second_s}}."""
    import torch

    from gpu_parts import rows as R
    from m2po_megatron.actor.actor import MegatronActor

    deadline = time.monotonic() + budget_s - 5
    on_gpu = cuda()
    out: dict = {"row_tokens": ROW, "models": {}}
    for name, recompute in models:
        if time.monotonic() > deadline:
            out["models"][name] = {"skipped": "no time left"}
            continue
        cfg = model_config(name, smoke)
        batch = R.rollout_batch(2, ROW, cfg["vocab_size"], seed=1, scale=ROW / R.RECIPE_ROW)
        actor = MegatronActor(hf_config=cfg, params_dtype="bf16" if on_gpu else "fp32", micro_batch_tokens=ROW,
                              lr=1e-6, loss_name="m2po", seed=0, recompute_granularity=recompute)
        times = []
        for _ in range(2):
            t0 = time.monotonic()
            actor.train_step(batch)
            sync()
            times.append(round(time.monotonic() - t0, 2))
        out["models"][name] = {"first_s": times[0], "second_s": times[1],
                                                   "compile_s": round(times[0] - times[1], 2),
                                                   "attention_backend": actor.attention_backend}
        actor.close()
        del actor
        if on_gpu:
            torch.cuda.empty_cache()
    return out
