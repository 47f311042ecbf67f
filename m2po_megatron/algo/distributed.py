"""The batch-level M2PO mask over micro-batches and data-parallel ranks (the only distributed module of algo/).

Use (one optimizer mini-batch, every rank of the model):
    res = global_m2po_keep_masks(log_ratios, advs, masks, tau=0.04, group=dp_group)   # no grad, once
    for mb, keep in zip(micro_batches, res.keep_masks):
        loss, m = policy_loss("m2po", lp, blp, adv, mask, keep_mask=keep,
                              num_tokens=res.num_tokens, num_seqs=res.num_seqs)
        loss.backward()
The summed gradient over micro-batches and DP ranks is then exactly the gradient of the full mini-batch
loss with the mask of the concatenated mini-batch (micro-batches in order, ranks in group-rank order).

Which group: the ranks that hold *different* tokens of the mini-batch, i.e. Megatron's data-parallel
group (parallel_state.get_data_parallel_group(); with_context_parallel=True if each context-parallel rank
holds its own slice of tokens, False if log-probs were gathered over CP). Tensor- and pipeline-parallel
replicas each call with their own DP group, compute the same result, and nothing is counted twice. Passing
a group that contains replicas would count their tokens twice, so with torch.distributed initialised and
more than one rank, `group` is required.

Communication per call (P ranks in the group, |T_r| trust-region tokens on rank r):
  - scope="minibatch": one all_gather of 6 float64 counters (48 P bytes) and one all_gather of the
    trust-region log-ratios as float64, padded to max_r |T_r| (each rank receives 8 P max_r |T_r| bytes;
    e.g. 64 prompts x 8 rollouts x 2.5k tokens, half of them in T: ~5 MB in total). Every rank then
    sorts the same global vector, so ties and rounding are identical to one process.
  - scope="microbatch" (the released code: each micro-batch masked on its own): only the first all_gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from m2po_megatron.algo._layout import (
    as_bool_mask,
    check_same_shape,
    nonfinite_counts,
    raise_nonfinite,
    valid_tokens,
)
from m2po_megatron.algo.mask import (
    bounded_tokens,
    check_m2_tokens,
    check_tau_rule,
    keep_trust_region,
    keep_trust_region_values,
)
from m2po_megatron.algo.metrics import from_partials, to_partials

Tensor = torch.Tensor
SCOPES = ("minibatch", "microbatch")


@dataclass
class GlobalM2POMask:
    """Result of global_m2po_keep_masks; all counts and M2 values are over the whole group."""

    keep_masks: list[Tensor]  # per input micro-batch, its shape; True = valid and not dropped
    num_tokens: int  # valid tokens of the mini-batch (the token-mean denominator)
    num_seqs: int  # sequences with >= 1 valid token (-1 if flat inputs came without seq_ids)
    num_trust_region: int
    num_dropped: int
    m2_before: float  # mean (log r)^2 over T
    m2_after: float  # mean (log r)^2 over the kept T tokens


def _world(group) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("group was given but torch.distributed is not initialised")
        return 1
    if group is None:
        if dist.get_world_size() > 1:
            raise ValueError(
                "pass group= the data-parallel group (e.g. megatron.core.parallel_state.get_data_parallel_group()); "
                "the default group would count tensor/pipeline-parallel replicas more than once"
            )
        return 1
    return dist.get_world_size(group)


def _as_list(x, n=None) -> list:
    if x is None:
        return [None] * (n or 1)
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _all_gather(t: Tensor, group, world: int) -> list[Tensor]:
    if world == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def _local(log_ratios, advantages, masks, seq_ids, tokens="trust_region"):
    """This rank's micro-batches, flattened and concatenated in order: (bool masks per micro-batch, log-ratios,
    trust-region flags, sizes, device counters [valid tokens, sequences or -1, NaN/inf log-ratios,
    NaN/inf advantages]). Nothing here reads the device."""
    ms, lrs, trs, tok, seqs, bad = [], [], [], [], [], []
    for i, (lr, adv, m, sid) in enumerate(zip(log_ratios, advantages, masks, seq_ids)):
        m = as_bool_mask(m, f"masks[{i}]")
        check_same_shape(f"log_ratios[{i}]", lr, **{f"advantages[{i}]": adv, f"masks[{i}]": m})
        bad.append(nonfinite_counts(m, lr, adv))
        lr = lr.detach()
        ok = m & torch.isfinite(lr) & torch.isfinite(adv)  # non-finite tokens stay off T until the raise
        ms.append(m)
        lrs.append(torch.where(ok, lr, torch.zeros_like(lr)).reshape(-1).to(torch.float64))
        trs.append(bounded_tokens(lr, adv.detach(), ok, tokens).reshape(-1))
        tok.append(m.sum())
        vt = valid_tokens(m, sid, "global_m2po_keep_masks")
        seqs.append(vt.num_seqs() if vt.known_seqs else None)
    dev = lrs[0].device
    n_seqs = (torch.full((), -1.0, dtype=torch.float64, device=dev) if any(x is None for x in seqs)
              else torch.stack(seqs).sum().to(torch.float64))
    bad_t = torch.stack(bad).sum(0).to(torch.float64)
    counters = torch.stack([torch.stack(tok).sum().to(torch.float64), n_seqs, bad_t[0], bad_t[1]])
    return ms, lrs, trs, [t.numel() for t in lrs], counters, bad


def _flag_positions(flags: Tensor, count: int) -> Tensor:
    """Positions of the True entries of `flags`, in order, given their number (known on the host): nonzero
    without its device read. Each flagged position goes to its rank among the flagged (a cumulative sum);
    the rest go to a spare slot that is dropped."""
    rank = torch.cumsum(flags, 0) - 1
    out = torch.zeros(count + 1, dtype=torch.long, device=flags.device)
    slot = torch.where(flags, rank, torch.full_like(rank, count))
    return out.scatter_(0, slot, torch.arange(flags.numel(), device=flags.device))[:count]


def _raise_nonfinite(table, bad, world):
    """After the first gather: every rank raises if any rank saw NaN/inf, naming the tensor where it can."""
    if not any(row[-1] > 0 or row[-2] > 0 for row in table):
        return
    for i, counts in enumerate(torch.stack(bad).tolist()):  # error path only: read this rank's details
        raise_nonfinite("global_m2po_keep_masks", (f"log_ratios[{i}]", f"advantages[{i}]"), counts)
    ranks = [r for r in range(world) if table[r][-1] > 0 or table[r][-2] > 0]
    raise ValueError(f"global_m2po_keep_masks: data-parallel rank(s) {ranks} hold NaN or inf log-ratios or "
                     "advantages on valid tokens (their error names the micro-batch); fix the forward pass or "
                     "mask those tokens out")


@torch.no_grad()
def global_m2po_keep_masks(
    log_ratios: Tensor | Sequence[Tensor],
    advantages: Tensor | Sequence[Tensor],
    masks: Tensor | Sequence[Tensor],
    *,
    tau: float = 0.04,
    rule: str = "remove",
    scope: str = "minibatch",
    group=None,
    seq_ids: Tensor | Sequence[Tensor] | None = None,
    tokens: str = "trust_region",
) -> GlobalM2POMask:
    """M2PO keep masks for this rank's micro-batches, decided over the whole mini-batch of the group.

    Args:
        log_ratios, advantages, masks: one tensor or a list (one per micro-batch, in processing order) of
            per-token log pi_theta - log pi_behav, advantages and valid masks; each padded [B, T] or flat [N]
            (flat ones may pass seq_ids so that sequences are counted).
        tau, rule, tokens: as in m2po_keep_mask (with tokens="all", "trust-region" below means every valid token).
        scope: "minibatch" (default: the paper's batch-level constraint over all micro-batches and ranks) or
            "microbatch" (each micro-batch masked on its own, as the released code does).
        group: the data-parallel process group (see module doc); None for a single process.
        seq_ids: flat inputs only, integer sequence ids per micro-batch.

    Returns:
        GlobalM2POMask: per-micro-batch keep masks and the global denominators/diagnostics. With scope
        "minibatch" the masks equal m2po_keep_mask over the concatenation of all micro-batches of all ranks
        (row-major valid tokens, micro-batches in order, ranks in group-rank order), ties included.

    Host syncs: one read of the gathered counters per call, however many micro-batches (the per-micro-batch
    work reads nothing). Raises ValueError on every rank if any rank holds NaN/inf on a valid token.
    """
    check_tau_rule(tau, rule)
    check_m2_tokens(tokens)
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    log_ratios, advantages, masks = _as_list(log_ratios), _as_list(advantages), _as_list(masks)
    if not (len(log_ratios) == len(advantages) == len(masks)) or not log_ratios:
        raise ValueError("log_ratios, advantages and masks must be lists of the same, non-zero length")
    seq_ids = _as_list(seq_ids, len(masks))
    if len(seq_ids) != len(masks):
        raise ValueError("seq_ids must have one entry per micro-batch")
    world = _world(group)
    ms, lrs, trs, sizes, counters, bad = _local(log_ratios, advantages, masks, seq_ids, tokens)
    dev = lrs[0].device
    lr_all, tr_all = torch.cat(lrs), torch.cat(trs)
    v_all = lr_all.square()

    if scope == "microbatch":
        keep_all = torch.cat([keep_trust_region(lr, tr, tau, rule) for lr, tr in zip(lrs, trs)])
        kept = tr_all & keep_all
        sums = torch.stack([(v_all * tr_all).sum(), (v_all * kept).sum(), kept.sum().to(torch.float64)])
    else:
        sums = torch.zeros(3, dtype=torch.float64, device=dev)
    counters = torch.cat([tr_all.sum().to(torch.float64).reshape(1), counters[:2], sums, counters[2:]])
    table = torch.stack(_all_gather(counters, group, world)).tolist()  # collective 1; the one host read
    _raise_nonfinite(table, bad, world)
    n_tr = [int(row[0]) for row in table]
    num_tokens = int(sum(row[1] for row in table))
    num_seqs = -1 if any(row[2] < 0 for row in table) else int(sum(row[2] for row in table))
    total_t = sum(n_tr)

    if scope == "microbatch":
        sum_before, sum_after, n_kept = (sum(row[c] for row in table) for c in (3, 4, 5))
    else:
        me = dist.get_rank(group) if world > 1 else 0
        n_t = n_tr[me]
        t_pos = _flag_positions(tr_all, n_t)
        local_vals = lr_all[t_pos]
        max_t = max(n_tr)
        if world > 1 and max_t > 0:  # collective 2: only the trust-region log-ratios
            padded = torch.zeros(max_t, dtype=torch.float64, device=dev)
            padded[:n_t] = local_vals
            gathered = _all_gather(padded, group, world)
            global_vals = torch.cat([g[:c] for g, c in zip(gathered, n_tr)])
        else:
            global_vals = local_vals
        keep_global = keep_trust_region_values(global_vals, tau, rule)
        v = global_vals.square()
        sum_before, sum_after, n_kept = torch.stack(
            [v.sum(), (v * keep_global).sum(), keep_global.sum().to(torch.float64)]).tolist()
        offset = sum(n_tr[:me])
        keep_all = torch.ones_like(tr_all)
        keep_all[t_pos] = keep_global[offset:offset + n_t]

    keep_masks = [(m.reshape(-1) & k).reshape(m.shape) for m, k in zip(ms, torch.split(keep_all, sizes))]
    return GlobalM2POMask(
        keep_masks=keep_masks,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        num_trust_region=total_t,
        num_dropped=total_t - int(n_kept),
        m2_before=sum_before / total_t if total_t else 0.0,
        m2_after=sum_after / n_kept if n_kept else 0.0,
    )


def _device_for(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def global_token_counts(masks: Tensor | Sequence[Tensor], *, group=None,
                        seq_ids: Tensor | Sequence[Tensor] | None = None) -> tuple[int, int]:
    """(num_tokens, num_seqs) over all micro-batches and the group's ranks: one all_reduce of 2 numbers and
    one host read.
    Use as policy_loss denominators for losses that need no M2PO mask (grpo, grpo_notr, gspo)."""
    masks = _as_list(masks)
    seq_ids = _as_list(seq_ids, len(masks))
    world = _world(group)
    toks, seqs = [], []
    for i, (m, sid) in enumerate(zip(masks, seq_ids)):
        m = as_bool_mask(m, f"masks[{i}]")
        toks.append(m.sum().to(torch.float64))
        vt = valid_tokens(m, sid, "global_token_counts")
        seqs.append(vt.num_seqs().to(torch.float64) if vt.known_seqs else None)
    dev = _device_for(group) if world > 1 else (toks[0].device if toks else torch.device("cpu"))
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    n_seq = (torch.full((), -1e18, dtype=torch.float64, device=dev) if any(x is None for x in seqs)
             else sum((x.to(dev) for x in seqs), zero))
    t = torch.stack([sum((x.to(dev) for x in toks), zero), n_seq])
    if world > 1:
        dist.all_reduce(t, group=group)
    tok, seq = t.tolist()  # the one host read
    return int(tok), (-1 if seq < 0 else int(seq))


@torch.no_grad()
def all_reduce_partials(sums: dict[str, float], mins: dict[str, float], maxes: dict[str, float], *, group=None
                        ) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Metric partials (algo.metrics.to_partials / sum_partials) added up over the group's ranks, with three
    small all_reduces (sum, min, max) of float64 values; keys come back sorted. Every rank must pass the same
    keys."""
    if _world(group) == 1:
        return tuple({k: d[k] for k in sorted(d)} for d in (sums, mins, maxes))
    dev = _device_for(group)
    out = []
    for d, op in ((sums, dist.ReduceOp.SUM), (mins, dist.ReduceOp.MIN), (maxes, dist.ReduceOp.MAX)):
        keys = sorted(d)
        t = torch.tensor([d[k] for k in keys], dtype=torch.float64, device=dev)
        if keys:
            dist.all_reduce(t, op=op, group=group)
        out.append(dict(zip(keys, t.cpu().tolist())))
    return out[0], out[1], out[2]


@torch.no_grad()
def all_reduce_metrics(metrics: dict[str, float], *, group=None, loss: str = "sum") -> dict[str, float]:
    """Combine a (micro-batch-reduced) policy_loss metric dict over the group's ranks exactly, with three
    small all_reduces (sum, min, max). Every rank must pass the same keys."""
    return from_partials(*all_reduce_partials(*to_partials(metrics, loss), group=group), loss)
