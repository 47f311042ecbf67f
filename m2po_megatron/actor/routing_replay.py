"""Routing replay for mixture-of-experts models: each MoE layer's router takes recorded experts instead of its
own top-k (verl's R2 and R3), through megatron-core's RouterReplay hook, and counts what it saw.

Targets are per token and layer, k expert ids, or -1 where nothing was recorded (prompt tokens the engine did
not report, padding, fillers): there the router routes as usual. The same targets are used in the forward and
in a full-recompute backward (megatron re-runs the layer inside autograd's backward; the targets of the
micro-batches in flight wait in a FIFO per layer, in schedule order). Each layer counts, on the device:
tokens with a target and tokens whose own top-k differs from it (the routing mismatch), in forward and in
recompute separately, and the tokens each expert received (the load).

Which targets: R3 replays the rollout engine's routing (TrainBatch.routed_experts); R2 records the trainer's
own routing at the step's starting weights in a no-grad pass (`record`) and replays it in every update of the
step. `none` installs the same hook to count the load and changes nothing."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

REPLAY_MODES = ("none", "r2", "r3")


def _in_backward() -> bool:
    """Running inside autograd's backward (a full-recompute re-run of the layer's forward)."""
    return torch._C._current_graph_task_id() != -1


def _routers(chunks) -> list:
    """(global layer index, TopKRouter) of every MoE layer of this rank, in layer order."""
    from m2po_megatron.models.loading import unwrap

    out = []
    for chunk in chunks:
        for layer in unwrap(chunk).decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if router is not None:
                out.append((layer.layer_number - 1, router))
    return out


def layer_replay_class():
    """The class of one MoE layer's replay hook, built on first use (megatron-core imports late)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    class LayerReplay(RouterReplay):
        """One MoE layer's replay: megatron's RouterReplay with partial targets, the recompute FIFO and counts."""

        def __init__(self, num_experts: int, recompute: bool):
            super().__init__()
            RouterReplay.global_router_replay_instances.remove(self)  # ours, not megatron's global switch
            self.num_experts, self.recompute = num_experts, recompute
            self.target: Optional[torch.Tensor] = None
            # replay the target / count this pass (set per _run; only a training pass counts, and it alone is
            # followed by a backward)
            self.apply, self.count = True, False
            self.fifo: list[Optional[tuple]] = []
            self.record_into: Optional[list] = None
            self.counts: Optional[torch.Tensor] = None  # [2 passes, 2 (targets, mismatches)]
            self.load: Optional[torch.Tensor] = None  # [E] tokens per expert (forward)

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            recompute = _in_backward()
            if recompute:  # the same target, flags and counting as this micro-batch's forward had
                target, apply, count = self.fifo.pop(0) if self.fifo else (None, False, False)
            else:
                target, apply, count = self.target, self.apply, self.count
                if self.recompute and count:  # a training pass: a backward will re-run this forward
                    self.fifo.append((target, apply, count))  # (megatron runs the first forward under no_grad)
            if self.record_into is not None and not recompute:
                self.record_into.append(own.detach().to(torch.int16))
            used = own
            if target is not None:
                if target.shape != own.shape:  # torch.where would broadcast a (1, k) slice over every token
                    raise RuntimeError(
                        f"routing replay of layer {self.layer_number}: targets {tuple(target.shape)} for a router "
                        f"that sees {tuple(own.shape)} (tokens, top-k): the targets must be this rank's rows of "
                        "the micro-batch exactly (its sequence-parallel share)")
                target = target.to(own.device).long()
                has = target[:, 0] >= 0
                if apply:
                    used = torch.where(has[:, None], target, own)
                    probs = scores.gather(1, used)  # what megatron's replay does: the scores at the replayed ids
                if count:
                    differ = (own.sort(1).values != target.sort(1).values).any(1) & has
                    self._count(int(recompute), has.sum(), differ.sum(), own.device)
            if count and not recompute:
                self._load(used)
            return probs, used

        def _count(self, row: int, n_target, n_differ, dev) -> None:
            if self.counts is None:
                self.counts = torch.zeros(2, 2, dtype=torch.long, device=dev)
            self.counts[row, 0] += n_target
            self.counts[row, 1] += n_differ

        def _load(self, used: torch.Tensor) -> None:
            flat = used.detach().flatten()  # a scatter-add: a fixed shape, no host sync (bincount reads the max)
            n = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device).index_add_(
                0, flat, torch.ones_like(flat))
            self.load = n if self.load is None else self.load + n

        def reset(self) -> None:
            self.target, self.fifo, self.counts, self.load = None, [], None, None

    return LayerReplay


def check_routing_replay(spec, mode: str, context_parallel_size: int = 1) -> None:
    """The replay mode fits the model and layout (ValueError naming the field and the fix)."""
    if mode not in REPLAY_MODES:
        raise ValueError(f"algo.routing_replay = {mode!r}: use one of {REPLAY_MODES}")
    if mode != "none" and not spec.is_moe:
        raise ValueError(f"algo.routing_replay = {mode!r} needs a mixture-of-experts model; {spec.architecture} is "
                         "dense: use none")
    if mode != "none" and context_parallel_size > 1:
        raise ValueError("algo.routing_replay with context_parallel_size > 1 is not supported (the targets would "
                         "have to follow megatron's context-parallel split): use context_parallel_size = 1")


class RoutingReplay:
    """Installs one LayerReplay per MoE router of this rank and feeds it each micro-batch's targets."""

    def __init__(self, chunks, *, mode: str, num_experts: int, topk: int, recompute: bool):
        if mode not in REPLAY_MODES:
            raise ValueError(f"algo.routing_replay = {mode!r}: use one of {REPLAY_MODES}")
        self.mode, self.num_experts, self.topk = mode, num_experts, topk
        self.sp_split = (0, 1)  # (rank, size): with sequence parallelism a router sees its TP rank's rows
        cls = layer_replay_class()
        self.layers: list[tuple[int, object]] = []
        for layer, router in _routers(chunks):
            hook = cls(num_experts, recompute)
            hook.layer_number = layer + 1
            router.router_replay = hook
            self.layers.append((layer, hook))
        if chunks:
            from m2po_megatron.models.loading import unwrap

            cfg = unwrap(chunks[0]).config
            if cfg.sequence_parallel:
                from megatron.core import parallel_state as ps

                self.sp_split = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())

    @property
    def layer_ids(self) -> list[int]:
        return [i for i, _ in self.layers]

    def reset(self) -> None:
        for _, h in self.layers:
            h.reset()

    def before_forward(self, targets: Optional[torch.Tensor]) -> None:
        """Set every layer's target for the next micro-batch: [S, layers of this rank, k] or None."""
        if targets is not None:
            targets = sp_share(targets, *self.sp_split)
        for j, (_, h) in enumerate(self.layers):
            h.target = None if targets is None else targets[:, j, :]

    def targets_for(self, batch, replay: bool, count: bool = False):
        """targets(mb) for the actor's next _run over micro-batches of `batch`: its routed_experts, applied when
        `replay` and the mode replays (r2, r3); counted (mismatch, load) when `count`. With no recorded routing
        the rows get no target (own routing), still counted for the load."""
        apply = replay and self.mode != "none"
        for _, h in self.layers:
            h.apply, h.count = apply, count
        routed = batch.routed_experts if self.mode != "none" else None
        if routed is not None:
            check_routed(routed, self.num_experts, self.topk, self.layer_ids)
        ids = self.layer_ids
        return lambda mb: row_targets(routed, mb, ids, self.topk)

    @contextlib.contextmanager
    def recording(self):
        """Collect each layer's own top-k of every forward in order: yields {layer index: [tensors]}."""
        out = {i: [] for i, _ in self.layers}
        for i, h in self.layers:
            h.record_into = out[i]
        try:
            yield out
        finally:
            for _, h in self.layers:
                h.record_into = None

    # ---- a training step: R2's recording, R3's log-prob diagnostics, the step's counts -------------------
    def prepare_step(self, actor, batch, minis: list[list[int]]):
        """Before the step's updates: (the batch to train on, metrics). Counters start from zero. R2: record the
        trainer's routing of every sequence at the step's weights (it becomes batch.routed_experts); the log-prob
        mismatch to the behaviour policy without replay comes from the same pass. R3 with recorded routing: the
        mismatch with and without replay, from two no-grad passes at the step's weights."""
        self.reset()
        if self.mode == "r2":
            return record_step(actor, self, batch, minis)
        if self.mode == "r3" and batch.routed_experts is not None and batch.behav_log_probs is not None:
            out = {"routing/replayed_seqs": float(sum(r is not None for r in batch.routed_experts))}
            for key, replay in (("routing/logprob_mismatch_noreplay", False), ("routing/logprob_mismatch", True)):
                lp, _ = actor.compute_log_probs(batch, with_entropy=False, replay=replay)
                out[key] = _mean_abs_diff(lp, batch.behav_log_probs, batch.loss_mask)
            self.reset()
            return batch, out
        return batch, {}

    def step_metrics(self, actor) -> dict[str, float]:
        """The step's counts over every data-parallel rank, pipeline stage and, with sequence parallelism,
        tensor-parallel rank (identical on every rank):
        per layer and in total, tokens with a recorded target and tokens whose own top-k differed from it
        (the routing mismatch, as a fraction), the tokens replayed again in a full recompute, and the expert
        load's max over mean (1 = balanced), per layer averaged."""
        import torch.distributed as dist

        dev = next(actor.model_chunks()[0].parameters()).device
        n = len(self.layers)
        counts = torch.zeros(n, 2, 2, dtype=torch.long, device=dev)
        loads = torch.zeros(n, self.num_experts, dtype=torch.long, device=dev)
        for j, (_, h) in enumerate(self.layers):
            if h.counts is not None:
                counts[j] = h.counts
            if h.load is not None:
                loads[j] = h.load
        for size, group in ((self.sp_split[1], actor.tp_group), (actor.dp_size, actor.dp_group)):
            if size > 1:  # sequence parallel: each TP rank routed its own share of the rows
                dist.all_reduce(counts, group=group)
                dist.all_reduce(loads, group=group)
        mine = (self.layer_ids, counts.cpu(), loads.cpu())
        stages = [mine]
        if actor.pp_size > 1:
            stages = [None] * actor.pp_size
            dist.all_gather_object(stages, mine, group=actor.pp_group)
        ids = [i for st in stages for i in st[0]]
        c = torch.cat([st[1] for st in stages]).float()
        ld = torch.cat([st[2] for st in stages]).float()
        out: dict[str, float] = {}
        if c[:, 0, 0].sum() > 0:
            for j, i in enumerate(ids):
                out[f"routing/mismatch/layer_{i}"] = float(c[j, 0, 1] / c[j, 0, 0].clamp_min(1))
            out["routing/mismatch"] = float(c[:, 0, 1].sum() / c[:, 0, 0].sum())
            out["routing/replayed_tokens"] = float(c[:, 0, 0].sum())
            out["routing/replayed_tokens_recompute"] = float(c[:, 1, 0].sum())
        if ld.sum() > 0:
            out["routing/load_max_over_mean"] = float((ld.max(1).values / ld.mean(1).clamp_min(1e-9)).mean())
        self.reset()
        return out


def _mean_abs_diff(a: list, b: list, mask: Optional[list] = None) -> float:
    """Mean |a - b| over the policy tokens (`mask`: TrainBatch.loss_mask; None: every token): an environment
    token's behaviour log-prob is no sample of the policy's."""
    x = torch.cat([t.float() for t in a])
    y = torch.cat([t.float() for t in b])
    if mask is not None:
        keep = torch.cat([m.bool() for m in mask])
        x, y = x[keep], y[keep]
    return float((x - y).abs().mean()) if x.numel() else 0.0


def check_routed(routed: list, num_experts: int, topk: int, layer_ids: list[int]) -> None:
    """Replay data the trainer can use (the rollout side drops bad samples before; this names what slipped)."""
    need = max(layer_ids) + 1 if layer_ids else 0
    for i, r in enumerate(routed):
        if r is None:
            continue
        if r.dim() != 3 or r.shape[2] != topk or r.shape[1] < need:
            raise ValueError(f"TrainBatch.routed_experts[{i}] has shape {tuple(r.shape)}: expected (tokens, layers "
                             f">= {need}, top-k = {topk})")
        if r.numel() and (int(r.max()) >= num_experts or int(r.min()) < -1):
            raise ValueError(f"TrainBatch.routed_experts[{i}] has expert ids outside [-1, {num_experts})")


@torch.no_grad()
def record_step(actor, replay: RoutingReplay, batch, minis: list[list[int]]):
    """R2: each mini-batch's share of this rank, planned as its update will plan it, through a no-grad pass
    that records every layer's own top-k; returns (the batch with routed_experts, the log-prob mismatch to the
    behaviour policy). Sequences of other ranks' shares stay None here: this rank never trains on them."""
    import torch.distributed as dist

    from .dp_share import rank_share
    from .global_mask import behav_and_advantages

    L, k, ids = actor.spec.num_layers, replay.topk, replay.layer_ids
    routed: list = [None] * len(batch)
    dev = next(actor.model_chunks()[0].parameters()).device
    acc = torch.zeros(2, dtype=torch.float64, device=dev)  # sum |logp - behav|, tokens (last stage)
    actor._eval_mode()
    for mi in minis:
        if not mi:
            continue
        sel, _, shard, filler = rank_share(batch.select(mi), actor.dp_size, actor.dp_rank)
        mbs = actor._plan(sel, shard)
        if actor.even:  # as _train_minibatch will plan it
            sel, _, mbs, n_fill = actor._even(sel, None, mbs)
            filler = filler or n_fill > 0

        def loss_fn(mb, model_out, sel=sel, n=len(mi)):
            lp = model_out[0].detach().float()
            if sel.behav_log_probs is not None and mb.seq_index[0] < n:
                x = behav_and_advantages(sel, mb, lp.device)
                if x.policy is None:
                    acc[0] += (lp - x.behav).abs().sum().double()
                    acc[1] += lp.numel()
                else:  # the policy's tokens only (an environment token's behaviour value may be anything)
                    acc[0] += torch.where(x.policy, (lp - x.behav).abs(), 0.0).sum().double()
                    acc[1] += x.policy.sum()
            return lp.new_zeros(()), {}

        for h in (h for _, h in replay.layers):
            h.apply, h.count = False, False
        with replay.recording() as rec:
            actor._run(mbs, loss_fn, forward_only=True)
        size = replay.sp_split[1]  # > 1: each TP rank's routers saw only its share of every row
        rows = [gather_sp_rows(r, actor.tp_group, size) if size > 1 else r.cpu()
                for r in split_recorded(rec, mbs, ids)]
        for mb, row in zip(mbs, rows):
            if row.shape[0] != mb.seq_len:
                raise RuntimeError(f"routing replay (r2): recorded {row.shape[0]} rows of a micro-batch of "
                                   f"{mb.seq_len} tokens; the recording must cover the whole packed row")
            for j, off, n in zip(mb.seq_index, mb.offsets, mb.lengths):
                if j >= len(mi):  # the filler
                    continue
                t = torch.full((n, L, k), -1, dtype=torch.int16)
                t[:, ids] = row[off:off + n]
                routed[mi[j]] = t
    replay.reset()
    if actor.is_last_stage and actor.dp_size > 1:
        dist.all_reduce(acc, group=actor.dp_group)
    acc = actor._on_all_stages(acc.cpu())
    out = batch.select(range(len(batch)))
    out.routed_experts = routed
    return out, ({"routing/logprob_mismatch_noreplay": float(acc[0] / acc[1])} if acc[1] > 0 else {})


def row_targets(routed: Optional[list], mb, layer_ids: list[int], topk: int) -> Optional[torch.Tensor]:
    """[S, len(layer_ids), k] int16 targets of one packed row from per-sequence routing ([len_i, L, k], -1 where
    none), or None when no sequence of the row has any."""
    if routed is None:
        return None
    parts = [routed[i] for i in mb.seq_index]
    if all(p is None for p in parts):
        return None
    out = torch.full((mb.seq_len, len(layer_ids), topk), -1, dtype=torch.int16)
    idx = torch.tensor(layer_ids, dtype=torch.long)
    for p, off, n in zip(parts, mb.offsets, mb.lengths):
        if p is not None:
            out[off:off + n] = p.index_select(1, idx)
    return out


def split_recorded(recorded: dict, mbs: list, layer_ids: list[int]) -> list[torch.Tensor]:
    """Per micro-batch [rows the routers saw, layers, k] int16 from `recording()`'s per-layer lists (one entry
    per forward), on the device: the whole row, or with sequence parallelism this TP rank's share of it."""
    return [torch.stack([recorded[i][m] for i in layer_ids], 1) for m in range(len(mbs))]


def sp_share(rows: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """A TP rank's share of a packed row's per-token data under sequence parallelism: megatron scatters the
    row's tokens to the TP ranks in equal contiguous blocks (the row is padded to a multiple of TP,
    actor/packing.row_multiple)."""
    if size == 1:
        return rows
    if rows.shape[0] % size:
        raise RuntimeError(f"routing replay: a packed row of {rows.shape[0]} tokens does not split over "
                           f"{size} sequence-parallel ranks (rows are padded to a multiple of TP)")
    step = rows.shape[0] // size
    return rows[rank * step:(rank + 1) * step]


def gather_sp_rows(share: torch.Tensor, group, size: int) -> torch.Tensor:
    """The whole packed row (host int16) from every TP rank's share (inverse of sp_share). int32 on the wire:
    NCCL has no int16."""
    import torch.distributed as dist

    x = share.to(torch.int32).contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts).to(torch.int16).cpu()
