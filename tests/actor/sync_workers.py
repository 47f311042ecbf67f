"""Workers for tests/actor/test_host_syncs.py (imported by spawned children, so no pytest imports here).

`SyncCounter` counts what makes the host wait for the device on a GPU, while it is active:
  - `_local_scalar_dense` (the aten op behind `.item()`, `float(t)`, `int(t)`, `bool(t)`), `nonzero` (and the
    boolean-mask indexing / `masked_select` / `unique` / `repeat_interleave` without output_size that need it),
    seen below the dispatcher, whoever calls them (megatron included);
  - `Tensor.tolist()` and `Tensor.cpu()` calls, seen at the Python API (tolist reads memory in C++ without an
    aten op);
  - `Tensor.to(device)` / `Tensor.cuda()` copies without `non_blocking=True` (a blocking host-to-device copy).
On CPU none of these waits for anything, but each is a point where a CUDA run would synchronise, so their count
is what the tests compare."""
from __future__ import annotations

import os
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_ATEN = {
    torch.ops.aten._local_scalar_dense.default: "item",
    torch.ops.aten.nonzero.default: "nonzero",
    torch.ops.aten.masked_select.default: "nonzero",
    torch.ops.aten._unique2.default: "unique",
    torch.ops.aten.unique_dim.default: "unique",
    torch.ops.aten.unique_consecutive.default: "unique",
}
_INDEX = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default)
_DEVICE_ARGS = (str, torch.device, int)
TRACE = Counter()  # (kind, file:line) -> count, filled when SYNC_TRACE=1 (to find where a count comes from)


def _note(counts, kind: str) -> None:
    counts[kind] += 1
    if os.environ.get("SYNC_TRACE"):
        import traceback

        skip = ("/torch/", "sync_workers", "cpu_compat")
        for fr in reversed(traceback.extract_stack()[:-2]):
            if not any(s in fr.filename for s in skip):
                TRACE[(kind, f"{fr.filename.split('site-packages/')[-1]}:{fr.lineno}")] += 1
                break


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ATEN:
            _note(self.counts, _ATEN[func])
        elif func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            _note(self.counts, "nonzero")  # the output length is read from the device
        elif func in _INDEX and any(i is not None and i.dtype == torch.bool for i in args[1]):
            _note(self.counts, "nonzero")  # boolean-mask indexing runs nonzero
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.tolist:
            _note(self.counts, "tolist")
        elif func is torch.Tensor.cpu:
            _note(self.counts, "cpu")
        elif func is torch.Tensor.cuda and not kwargs.get("non_blocking"):
            _note(self.counts, "blocking_copy")
        elif func is torch.Tensor.to and not kwargs.get("non_blocking") and (
                "device" in kwargs or (len(args) > 1 and isinstance(args[1], _DEVICE_ARGS))):
            if not (len(args) > 2 and args[2] is True):  # .to(device, dtype, non_blocking) positionally
                _note(self.counts, "blocking_copy")
        return func(*args, **kwargs)


class SyncCounter:
    """with SyncCounter() as c: ...; c.counts -> Counter of the kinds above; c.total their sum."""

    def __enter__(self):
        self.counts = Counter()
        self._f, self._d = _Function(self.counts), _Dispatch(self.counts)
        self._f.__enter__()
        self._d.__enter__()
        return self

    def __exit__(self, *exc):
        self._d.__exit__(*exc)
        self._f.__exit__(*exc)
        return False

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _batch(n_seqs: int, seq_len: int, vocab: int, seed: int):
    from m2po_megatron.actor.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (seq_len,), generator=g) for _ in range(n_seqs)]
    b = TrainBatch(ids, [3] * n_seqs)
    b.behav_log_probs = [-torch.rand(seq_len - 3, generator=g) * 3 for _ in range(n_seqs)]
    b.advantages = torch.randn(n_seqs, generator=g)
    return b


def count_worker(settings: list[dict]):
    """For each setting (actor kwargs + `n_mb`, the micro-batches the batch is packed into): the sync counts of
    one train_step and one compute_log_probs on the same batch (12 sequences of 16 tokens: the token budget
    makes exactly n_mb micro-batches of 12/n_mb sequences each), after one warm-up step."""
    from actor_workers import tiny_config

    from m2po_megatron.actor.actor import MegatronActor

    cfg = tiny_config("qwen2_untied")
    out = []
    for s in settings:
        s = dict(s)
        n_mb = s.pop("n_mb")
        n_seqs, seq_len = 12, 16
        actor = MegatronActor(hf_config=cfg, micro_batch_tokens=seq_len * n_seqs // n_mb, lr=1e-4, **s)
        batch = _batch(n_seqs, seq_len, cfg["vocab_size"], seed=1)
        actor.train_step(batch)  # warm-up: lazy state (optimizer state, cached flags) is built once
        TRACE.clear()
        with SyncCounter() as train:
            m = actor.train_step(batch)
        trace = {"train": dict(TRACE)}
        TRACE.clear()
        with SyncCounter() as logp:
            lp, _ = actor.compute_log_probs(batch)
        trace["logp"] = dict(TRACE)
        out.append({"train": dict(train.counts), "logp": dict(logp.counts), "num_microbatches": m["num_microbatches"],
                    "grad_norm": m["grad_norm"], "loss": m["loss"], "n_lp": len(lp), "trace": trace,
                    "times": {k: v for k, v in m.items() if k.startswith("time/actor/")}})
        actor.close()
    return out


def nonfinite_worker():
    """grpo (no batch-level mask, so the check is the loss's, read after the schedule): an advantage that is
    NaN must raise naming `advantages`, and leave the weights and the update count as they were."""
    from actor_workers import tiny_config

    from m2po_megatron.actor.actor import MegatronActor

    cfg = tiny_config("qwen2_untied")
    actor = MegatronActor(hf_config=cfg, micro_batch_tokens=64, lr=1e-2, loss_name="grpo")
    batch = _batch(12, 16, cfg["vocab_size"], seed=2)
    batch.advantages[5] = float("nan")
    before = [p.detach().clone() for p in actor.model[0].parameters()]
    try:
        actor.train_step(batch)
        error = None
    except ValueError as e:
        error = str(e)
    moved = max(float((p.detach() - b).abs().max()) for p, b in zip(actor.model[0].parameters(), before))
    out = {"error": error, "moved": moved, "updates": actor.updates_applied}
    batch.advantages[5] = 0.5  # the actor is usable afterwards
    out["next_loss"] = actor.train_step(batch)["loss"]
    out["moved_after"] = max(float((p.detach() - b).abs().max())
                             for p, b in zip(actor.model[0].parameters(), before))
    actor.close()
    return out


def grad_norm_worker(distributed_optimizer: bool):
    """TP2 (this group has 2 ranks): after one train_step without clipping, the step's grad norm (ours), our
    fused norm and megatron's own get_grad_norm_fp32 over the optimizer's grads, and the norm over every
    parameter's grad (duplicates included), which megatron's rule must differ from at TP2."""
    from actor_workers import tiny_config
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    from m2po_megatron.actor.actor import MegatronActor
    from m2po_megatron.actor.grad_norm import fused_grad_norm

    cfg = tiny_config("qwen2_untied")
    actor = MegatronActor(hf_config=cfg, micro_batch_tokens=64, lr=1e-3, clip_grad=0.0,
                          tensor_model_parallel_size=2, use_distributed_optimizer=distributed_optimizer)
    batch = _batch(12, 16, cfg["vocab_size"], seed=3)
    step_norm = actor.train_step(batch)["grad_norm"]
    opt = actor.optimizer
    group = opt.get_grad_stats_parallel_group()
    grads = [g for s in opt.chained_optimizers for g in s.get_grads_for_grad_norm()]
    everything = [p.main_grad for m in actor.model for p in m.parameters()]
    out = {"step": step_norm, "fused": fused_grad_norm(grads, group),
           "megatron": float(get_grad_norm_fp32(grads, grad_stats_parallel_group=group)),
           "all_params": fused_grad_norm(everything, group), "n_grads": len(grads), "n_params": len(everything),
           "hooked": "get_grad_norm" in vars(opt)}
    actor.close()
    return out
