"""The actor's forward-only passes: per-token log-probs (and entropy) of a batch at the current weights, and at
the reference model's (actor.reference). A mixin of MegatronActor (actor.py), which provides the model, the
parallel groups, the micro-batch planning and the schedule (_plan, _even, _run, _targets, _token_logps,
_eval_mode)."""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from m2po_megatron.infra.device import device

from .batch import TrainBatch
from .packing import shard_for_dp, to_device


class LogProbPasses:
    @torch.no_grad()
    def compute_log_probs(self, batch: TrainBatch, with_entropy: bool = True, replay: bool = False):
        """Per-token log-probs of every response token (and entropy) at the current weights (MoE: with the
        batch's routed_experts replayed when `replay`, else the trainer's own routing).

        Returns (log_probs, entropy): lists of 1-D fp32 CPU tensors (response length each; entropy None when
        with_entropy=False), identical on every rank."""
        batch.validate(for_training=False, vocab_size=self.spec.vocab_size, max_tokens=self.micro_batch_tokens)
        offs = [0, *itertools.accumulate(batch.response_lens)]
        shard = shard_for_dp(batch.lengths, self.dp_size)[self.dp_rank]  # empty shards add zeros in _share
        flat = self._forward_logps(batch, shard, offs, with_entropy, replay)
        lp = flat[0]
        ent = flat[1] if with_entropy else None
        split = lambda t: [t[offs[i]:offs[i + 1]].clone() for i in range(len(batch))]  # noqa: E731
        return split(lp), (split(ent) if ent is not None else None)

    def _forward_logps(self, batch: TrainBatch, shard: list[int], offs: list[int], with_entropy: bool,
                       replay: bool = False, model=None):
        """Forward-only over `shard` of `batch`; returns [2, total_response_tokens] (log-prob, entropy) for
        the whole batch, summed over DP and broadcast from the last stage (zeros where another shard).
        Each micro-batch's values stay on the device; they are placed with one index_copy after the schedule
        and come to the host with one copy (_share)."""
        out = torch.zeros(2, offs[-1], dtype=torch.float32, device=device())
        if shard or self.even:
            mbs = self._plan(batch, shard) if shard else []
            n_real = len(batch)
            if self.even:
                batch, _, mbs, _ = self._even(batch, None, mbs)
            parts: list[torch.Tensor] = []
            where: list[torch.Tensor] = []  # host: positions in `out` of each micro-batch's response tokens

            def loss_fn(mb, model_out):
                if mb.seq_index[0] >= n_real:  # a filler micro-batch (expert parallelism)
                    return model_out[0].new_zeros(()), {}
                lp, ent = self._token_logps(mb, model_out, with_entropy)
                ent = ent.float() if ent is not None else torch.zeros_like(lp, dtype=torch.float32)
                parts.append(torch.stack([lp.detach().float(), ent]))
                where.extend(torch.arange(offs[i], offs[i] + r) for i, r in zip(mb.seq_index, mb.response_lens))
                return model_out[0].new_zeros(()), {}

            self._eval_mode()
            self._run(mbs, loss_fn, forward_only=True, targets=self._targets(batch, replay), model=model)
            if parts:  # the last pipeline stage
                out.index_copy_(1, to_device(torch.cat(where), out.device), torch.cat(parts, 1))
        return self._share(out)

    @torch.no_grad()
    def reference_log_probs(self, batch: TrainBatch) -> list[torch.Tensor]:
        """The reference model's log-prob of every response token of `batch` (one 1-D fp32 CPU tensor per
        sequence, identical on every rank): one forward-only pass, its weights on the device meanwhile."""
        if self.reference is None:
            raise RuntimeError("this actor has no reference model (MegatronActor(reference=...))")
        offs = [0, *itertools.accumulate(batch.response_lens)]
        shard = shard_for_dp(batch.lengths, self.dp_size)[self.dp_rank]
        with self.reference.on_device(self.device) as chunks:
            flat = self._forward_logps(batch, shard, offs, False, model=chunks)
        return [flat[0, offs[i]:offs[i + 1]].clone() for i in range(len(batch))]

    def _share(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over DP (disjoint shards) on the last stage, then broadcast to every pipeline stage; the one
        device-to-host copy of compute_log_probs."""
        t = to_device(t, device())
        if self.is_last_stage and self.dp_size > 1:
            dist.all_reduce(t, group=self.dp_group)
        if self.pp_size > 1:
            dist.broadcast(t, src=self.ps.get_pipeline_model_parallel_last_rank(), group=self.pp_group)
        return t.cpu()
