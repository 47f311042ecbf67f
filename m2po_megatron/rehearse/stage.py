"""One rehearsed trainer rank: the recipe's MegatronActor built and stepped once at full size on fake tensors.

Runs in a process of its own (Megatron's parallel state and the fake process group are per process); see
m2po_megatron.rehearse for what is and is not traced. Nothing of the step is re-implemented here: this module
only chooses the rank, draws the batch, names the allocator's blocks and collects the numbers.
"""
from __future__ import annotations

import math
import os
import random
import time
from typing import Optional

# Rollout lengths as benchmarks/gpu_parts/rows.py draws them: prompts ~ N(150, 40) tokens clipped to [32, 400]
# (math problems after the chat template), responses log-uniform from 200 tokens to the recipe's
# rollout.max_new_tokens.
PROMPT_MEAN, PROMPT_SD, PROMPT_RANGE = 150, 40, (32, 400)
RESPONSE_MIN = 200


def draw_lengths(n: int, max_new_tokens: int, max_len: int, seed: int = 0,
                 response_min: int = RESPONSE_MIN) -> list[tuple[int, int]]:
    """n (prompt, response) token counts, prompt + response <= max_len (one packed row)."""
    rng = random.Random(seed)
    hi = max(response_min + 1, min(max_new_tokens, max_len - PROMPT_RANGE[0]))
    out = []
    for _ in range(n):
        p = min(max(round(rng.gauss(PROMPT_MEAN, PROMPT_SD)), PROMPT_RANGE[0]), PROMPT_RANGE[1], max_len // 4)
        r = round(math.exp(rng.uniform(math.log(response_min), math.log(hi))))
        out.append((p, max(1, min(r, max_len - p))))
    return out


def make_batch(lens: list[tuple[int, int]], vocab: int, seed: int = 0):
    """A TrainBatch of these lengths (real tensors: the step's inputs, tiny next to the model). The values do
    not matter on fake tensors; they are drawn as a real batch's would be."""
    import torch

    from m2po_megatron.actor.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (p + r,), generator=g) for p, r in lens]
    behav = [-math.log(vocab) + 0.05 * torch.randn(r, generator=g) for _, r in lens]
    adv = torch.where(torch.rand(len(lens), generator=g) < 0.5, -1.0, 1.0)
    return TrainBatch(ids, [p for p, _ in lens], behav, adv)


def _optimizer_tensors(optimizer) -> tuple[list, list]:
    """(the optimizer's own parameters: fp32 master copies, its state tensors: Adam's m and v)."""
    params, state = [], []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)
        for g in inner.param_groups:
            params.extend(g["params"])
        for st in inner.state.values():
            state.extend(v for v in st.values() if hasattr(v, "untyped_storage"))
    return params, state


def _place_reference(mode, ref) -> int:
    """The reference model's blocks (algo.use_kl_loss; actor/reference.py) as a GPU would hold them: offloaded,
    its host tensors leave the allocator model and their copies to the device in each pass are "reference"
    blocks; resident, its weights are "reference" blocks. Returns the build's peak bytes: with host tensors the
    peak starts again after the build, whose own peak counted them as device blocks."""
    build_peak = mode.peak
    if ref is None:
        return build_peak
    host = ref.host_tensors()
    if host:
        mode.untrack(host, copies_kind="reference")
        mode.reset_peak()
    else:
        mode.tag([t for c in ref.chunks for t in (*c.parameters(), *c.buffers())], "reference")
    return build_peak


def _peak_of(mode, fn, into: dict):
    """`fn` wrapped so that the allocator model's peak while it runs (and the kinds at it) lands in `into`."""
    def run(*a, **k):
        with mode.peak_within() as peak:
            out = fn(*a, **k)
        into.update(peak)
        return out
    return run


def _reference_info(actor, ref_pass: dict) -> Optional[dict]:
    ref = getattr(actor, "reference", None)
    if ref is None:
        return None
    return dict(offload=bool(ref.offload), bytes=int(ref.num_bytes()), host_tensors=len(ref.host_tensors()),
                pass_peak_bytes=ref_pass.get("peak_bytes", 0), pass_at_peak=ref_pass.get("at_peak", {}))


def rehearse_rank(kwargs: dict, *, rank: int, world_size: int, minibatch_seqs: int, max_new_tokens: int,
                  seed: int = 0, fast_cache: bool = True, crosscheck: int = 0, held_back_bytes: int = 0) -> dict:
    """Build MegatronActor(**kwargs) as global `rank` of a fake world and run one train_step of one optimizer
    mini-batch of `minibatch_seqs` sequences. Returns the rank's numbers (bytes, counts, seconds).
    fast_cache / crosscheck: the fake mode's first-level dispatch cache, and its check of every Nth hit
    (infra.fake_cache; 0: none). held_back_bytes: memory another process keeps on the GPU through the step (a
    colocated engine's share once released, models/colocated_memory.py): one fake block of that size, alive
    before the step starts and after it ends, so the traced peak includes it (kind "engine_resident")."""
    t0 = time.perf_counter()
    from m2po_megatron.infra import device

    from m2po_megatron.infra.fake_world import (CollectiveLog, RehearsalMode, balanced_moe_routing, init_fake_world,
                                                logged_collectives)

    import torch._dynamo

    # torch.compile'd functions (megatron's fused SwiGLU) run eagerly: compiling under fake tensors crashes the
    # process in inductor; eager saves the same tensors for backward (the Function saves its input)
    torch._dynamo.config.disable = True
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    init_fake_world(rank, world_size)
    device.set_rehearsal(True)
    mode = RehearsalMode(fast_cache=fast_cache, crosscheck=crosscheck)
    log = CollectiveLog()
    from m2po_megatron.actor.actor import MegatronActor

    mode.phase = "build"
    with mode, logged_collectives(log), balanced_moe_routing():
        actor = MegatronActor(**kwargs)
    t_build = time.perf_counter() - t0
    ps = actor.ps
    role = dict(pp_rank=ps.get_pipeline_model_parallel_rank(), tp_rank=ps.get_tensor_model_parallel_rank(),
                dp_rank=ps.get_data_parallel_rank(), pp_size=actor.pp_size, tp_size=actor.tp_size,
                dp_size=actor.dp_size, chunks=len(actor.model))
    params = [p for m in actor.model for p in m.parameters()]
    mode.tag(params, "weights")
    mode.tag([p.main_grad for p in params if getattr(p, "main_grad", None) is not None], "grads")
    # Adam's m and v exist in every step but a fresh run's first: make them now, as a resume does
    from m2po_megatron.actor.torch_adam import ensure_state

    ensure_state(actor.optimizer)  # outside the mode: Adam's `step` stays a real tensor (it is read on the host)
    opt_params, opt_state = _optimizer_tensors(actor.optimizer)
    mode.tag(opt_params + opt_state, "optimizer")
    build_peak = _place_reference(mode, getattr(actor, "reference", None))
    log.name_groups()
    log.calls.clear()  # the step's collectives only (set-up's are Megatron's group building)
    built = mode.live_bytes()

    lens = draw_lengths(minibatch_seqs, max_new_tokens, kwargs["micro_batch_tokens"], seed)
    batch = make_batch(lens, actor.spec.vocab_size, seed)
    step = actor.optimizer.step

    def traced_step(*a, **k):
        mode.phase = "optimizer_step"
        try:
            return step(*a, **k)
        finally:
            mode.tag(_optimizer_tensors(actor.optimizer)[1], "optimizer")  # Adam's m and v, made lazily
            mode.phase = "temporaries"

    actor.optimizer.step = traced_step
    ref_pass: dict = {}
    if getattr(actor, "reference", None) is not None:
        actor.reference_log_probs = _peak_of(mode, actor.reference_log_probs, ref_pass)
    held = None
    if held_back_bytes > 0:
        import torch

        mode.phase = "engine_resident"
        with mode:
            held = torch.empty(int(held_back_bytes), dtype=torch.uint8, device=params[0].device)
    mode.phase = "temporaries"
    t1 = time.perf_counter()
    with mode, mode.saved_as_activations(), logged_collectives(log), balanced_moe_routing():
        actor.train_step(batch, num_minibatches=1)
    t_step = time.perf_counter() - t1
    # the micro-batches this rank ran: its DP shard of the mini-batch, packed as train_step packs it
    from m2po_megatron.actor.packing import shard_for_dp

    shard = shard_for_dp(batch.lengths, actor.dp_size)[actor.dp_rank]
    mbs = actor._plan(batch, shard)
    out = dict(
        role, rank=rank, params=sum(p.numel() for p in params), peak_bytes=mode.peak, peak_phase=mode.peak_phase,
        at_peak=mode.breakdown(), built_bytes=built, microbatches=len(mbs), row_tokens=max(m.seq_len for m in mbs),
        sequences=len(shard), tokens=sum(batch.lengths[i] for i in shard), collectives=log.summary(),
        held_back_bytes=held.untyped_storage().nbytes() if held is not None else 0, build_peak_bytes=build_peak,
        reference=_reference_info(actor, ref_pass),
        build_s=round(t_build, 2), step_s=round(t_step, 2),
        dispatch_cache=dict(fast=mode.fast_enabled, hits=mode.fast_hits, misses=mode.fast_misses,
                            crosscheck=mode.crosscheck, checked=mode.fast_checked))
    actor.close()
    return out


def child_main(args: dict, out_path: str) -> None:
    """Entry of a rehearsal subprocess: rehearse_rank(**args), the result (or the error) as JSON at out_path."""
    import json
    import traceback

    try:
        res: Optional[dict] = rehearse_rank(**args)
        payload = {"ok": True, "result": res}
    except BaseException as e:  # reported by the parent with the rank's role
        payload = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    with open(out_path, "w") as f:
        json.dump(payload, f)
