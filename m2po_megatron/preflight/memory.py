"""The memory estimate (models/memory.py, as `m2po config` prints it) against one real step of the recipe's
first micro-batch: on a GPU the recipe's actor (actor.options.actor_kwargs, random weights) on one GPU, at
tensor/pipeline/context/expert parallel 1, trains one full micro-batch of train.micro_batch_tokens, and
torch's peak allocation is compared with that layout's estimate (tensors, without the allocator's overhead).
On CPU there is no device allocator to read: the recipe's estimate is computed (a model config that cannot be
read fails here) and the step is skipped, with the reason; `m2po rehearse` measures whole layouts on fake
tensors."""
from __future__ import annotations

import math
import os

from m2po_megatron.preflight.checks import CheckFailed, CheckSkipped

TOLERANCE = 0.10  # the goal: peak within 10 % of the estimate
PROMPT = 256


def _first_microbatch(vocab: int, row_tokens: int):
    """One packed row of row_tokens: sequences of a 256-token prompt and a 1,792-token response (the last one
    shorter), random ids, behaviour log-probs near a uniform model's, advantages +-1."""
    import torch

    from m2po_megatron.actor.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    lens, left = [], row_tokens
    while left > PROMPT + 16:
        n = min(left, 2048)
        lens.append((PROMPT, n - PROMPT))
        left -= n
    ids = [torch.randint(0, vocab, (p + r,), generator=g) for p, r in lens]
    behav = [-math.log(vocab) + 0.05 * torch.randn(r, generator=g) for _, r in lens]
    adv = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(lens))])
    return TrainBatch(ids, [p for p, _ in lens], behav, adv)


def run(cfg, ctx: dict) -> dict:
    from m2po_megatron.config import estimate_memory, model_hf_config

    hf = model_hf_config(cfg)
    if hf is None:
        where = cfg.model.hf_config or cfg.model.hf_path
        raise CheckFailed(f"the model's config.json cannot be read from {where!r} (model.hf_path / model.hf_config), "
                          "so there is no memory estimate", "download the weights (`m2po download RECIPE`) or point "
                          "model.hf_path at an HF model directory every node sees")
    est = estimate_memory(cfg, hf)
    numbers = {"recipe_estimate_gib": round(est["total"], 2)}
    if not ctx["gpu"]:
        raise CheckSkipped(f"no GPU: the estimate is of GPU memory and a CPU step has no allocator peak to compare; "
                           f"the recipe's layout needs {est['total']:.1f} GiB per GPU (m2po rehearse checks the "
                           "layout on fake tensors)", numbers)
    return _gpu_step(cfg, hf, numbers)


def _gpu_step(cfg, hf: dict, numbers: dict) -> dict:
    import torch

    from m2po_megatron.actor.actor import MegatronActor
    from m2po_megatron.actor.options import actor_kwargs
    from m2po_megatron.infra.net import rendezvous_env, serve_rendezvous
    from m2po_megatron.models.memory import estimate_gpu_memory

    one = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
               expert_model_parallel_size=1, expert_tensor_parallel_size=None, sequence_parallel=False,
               virtual_pipeline_model_parallel_size=None)
    kw = {**actor_kwargs(cfg), **one, "load_from": None, "reference": None}
    row = cfg.train.micro_batch_tokens
    est = estimate_gpu_memory(hf, micro_batch_tokens=row, params_dtype=kw["params_dtype"], fp8=bool(kw["fp8"]),
                              recompute=kw["recompute_granularity"], use_distributed_optimizer=False,
                              moe_aux_loss=(cfg.model.moe_aux_loss_coeff or 0) > 0)
    have = torch.cuda.get_device_properties(0).total_memory / 2**30
    numbers.update(one_gpu_estimate_gib=round(est["total"], 2), gpu_gib=round(have, 1))
    if est["total"] > have:
        raise CheckSkipped(f"the recipe's model needs {est['total']:.1f} GiB on one GPU at TP1 (this one has "
                           f"{have:.0f}); its layout is checked by `m2po rehearse` instead", numbers)
    store = serve_rendezvous("127.0.0.1")  # noqa: F841 - the one-rank group's store, alive for the step
    os.environ.update(rendezvous_env("127.0.0.1", store), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    actor = MegatronActor(**kw)
    batch = _first_microbatch(int(hf["vocab_size"]), row)
    torch.cuda.reset_peak_memory_stats()
    metrics = actor.train_step(batch)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    tensors = est["total"] - est["overhead"]
    numbers.update(peak_allocated_gib=round(peak, 2), estimate_tensors_gib=round(tensors, 2),
                   peak_over_estimate=round(peak / tensors, 3), loss=float(metrics["loss"]))
    if abs(peak / tensors - 1) > TOLERANCE:
        raise CheckFailed(f"one step of the first micro-batch peaked at {peak:.2f} GiB against an estimate of "
                          f"{tensors:.2f} GiB of tensors ({peak / tensors - 1:+.0%}, more than {TOLERANCE:.0%} off)",
                          "the estimate is wrong for this stack: plan with headroom (lower train.micro_batch_tokens "
                          "or raise parallel.recompute_granularity) and report the numbers", numbers)
    return numbers
