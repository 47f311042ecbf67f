"""One rank of the distributed algo test (run as a script by test_algo_distributed.py; gloo on CPU).

Every rank builds the same full mini-batch from a seed, takes its data-parallel share (uneven sequence
counts, 1-3 micro-batches of different widths), and checks that the batch-level mask, the denominators,
the summed loss, the gradients and the reduced metrics equal those of one process on the concatenation.
With --replicas 2, ranks 2d and 2d+1 hold the same data (like tensor-parallel replicas) and use the DP
group {0, 2} or {1, 3}; nothing may be counted twice.
"""

import argparse
import datetime
import math
import sys

import torch
import torch.distributed as dist

from m2po_megatron.algo import (
    all_reduce_metrics,
    global_m2po_keep_masks,
    global_token_counts,
    m2po_keep_mask,
    policy_loss,
    reduce_metrics,
)


def build_batch(seed: int, num_seqs: int, dp: int):
    """Sequences (list of dicts) and, per DP rank, a list of micro-batches (lists of sequence indices)."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for s in range(num_seqs):
        length = int(torch.randint(1, 12, (1,), generator=g))
        # Coarse grid values (k/8) create many exact ties, inside ranks and across them.
        lr = torch.randint(-6, 7, (length,), generator=g).float() / 8
        blp = -torch.randint(0, 48, (length,), generator=g).float() / 16  # exact: blp + lr - blp == lr
        a = float(torch.randint(-2, 3, (1,), generator=g)) / 2  # some sequences have A = 0
        valid = torch.rand(length, generator=g) > 0.15
        seqs.append(dict(lr=lr, blp=blp, adv=torch.full((length,), a), valid=valid, id=s))
    # Uneven DP shares: rank d gets a contiguous chunk whose size grows with d.
    weights = [d + 1 for d in range(dp)]
    cuts = [0]
    for w in weights:
        cuts.append(cuts[-1] + round(num_seqs * w / sum(weights)))
    cuts[-1] = num_seqs
    shares = []
    for d in range(dp):
        idx = list(range(cuts[d], cuts[d + 1]))
        n_mb = 1 + d % 3
        step = max(1, math.ceil(len(idx) / n_mb))
        shares.append([idx[i:i + step] for i in range(0, len(idx), step)] or [[]])
    return seqs, shares


def pad(seqs, members):
    """Padded [b, Tmax] tensors of one micro-batch (mask False on padding)."""
    tmax = max([len(seqs[i]["lr"]) for i in members] + [1])
    out = {k: torch.zeros(len(members), tmax) for k in ("lr", "blp", "adv")}
    out["mask"] = torch.zeros(len(members), tmax, dtype=torch.bool)
    for row, i in enumerate(members):
        n = len(seqs[i]["lr"])
        for k in ("lr", "blp", "adv"):
            out[k][row, :n] = seqs[i][k]
        out["mask"][row, :n] = seqs[i]["valid"]
    return out


def flat_of(mbs):
    """Flat concatenation of padded micro-batches, row-major, with a sequence id per position."""
    cat = {k: torch.cat([mb[k].reshape(-1) for mb in mbs]) for k in ("lr", "blp", "adv", "mask")}
    ids, base = [], 0
    for mb in mbs:
        b, t = mb["mask"].shape
        ids.append((torch.arange(b) + base).repeat_interleave(t))
        base += b
    cat["seq"] = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)
    return cat


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def run_case(rank, group, dp_rank, dp, seed, name, rule, agg, scope):
    seqs, shares = build_batch(seed, num_seqs=23, dp=dp)
    all_mbs = [[pad(seqs, m) for m in share] for share in shares]
    my_mbs = all_mbs[dp_rank]
    ref = flat_of([mb for share in all_mbs for mb in share])
    mine = flat_of(my_mbs)
    # Position of this rank's tokens inside the reference concatenation.
    offset = sum(mb["mask"].numel() for share in all_mbs[:dp_rank] for mb in share)
    span = slice(offset, offset + mine["mask"].numel())
    tau = 0.03

    # Single-process reference on the concatenated mini-batch.
    ref_lp = (ref["blp"] + ref["lr"]).requires_grad_()
    ref_keep = m2po_keep_mask(ref["lr"], ref["adv"], ref["mask"], tau=tau, rule=rule)
    kw = dict(loss_agg_mode=agg, seq_ids=ref["seq"])
    if name == "m2po":
        ref_loss, ref_metrics = policy_loss(name, ref_lp, ref["blp"], ref["adv"], ref["mask"], keep_mask=ref_keep, **kw)
    else:
        ref_loss, ref_metrics = policy_loss(name, ref_lp, ref["blp"], ref["adv"], ref["mask"], **kw)
    ref_loss.backward()

    if name == "m2po":
        res = global_m2po_keep_masks([mb["lr"] for mb in my_mbs], [mb["adv"] for mb in my_mbs],
                                     [mb["mask"] for mb in my_mbs], tau=tau, rule=rule, scope=scope, group=group)
        keeps = res.keep_masks
        num_tokens, num_seqs = res.num_tokens, res.num_seqs
        got = torch.cat([k.reshape(-1) for k in keeps])
        if scope == "minibatch":
            check(torch.equal(got, ref_keep[span]), f"rank {rank}: global mask differs from the concatenated batch")
            check(res.num_dropped == int((ref["mask"] & ~ref_keep).sum()), "num_dropped")
            check(abs(res.m2_before - ref_metrics["m2po/m2_before"]) < 1e-12, "m2_before")
            check(abs(res.m2_after - ref_metrics["m2po/m2_after"]) < 1e-12, "m2_after")
        else:
            for mb, k in zip(my_mbs, keeps):
                check(torch.equal(k, m2po_keep_mask(mb["lr"], mb["adv"], mb["mask"], tau=tau, rule=rule)),
                      f"rank {rank}: microbatch scope must mask each micro-batch on its own")
        check(res.num_trust_region == int(ref_metrics["m2po/num_trust_region"]), "num_trust_region")
    else:
        keeps = [None] * len(my_mbs)
        num_tokens, num_seqs = global_token_counts([mb["mask"] for mb in my_mbs], group=group)
    check(num_tokens == int(ref["mask"].sum()), f"rank {rank}: num_tokens {num_tokens} vs {int(ref['mask'].sum())}")
    check(num_seqs == int(ref_metrics["count/seqs"]), f"rank {rank}: num_seqs {num_seqs}")
    if scope == "microbatch":
        return  # the loss then intentionally differs from the batch-level one

    grads, losses, metrics = [], [], []
    for mb, keep in zip(my_mbs, keeps):
        lp = (mb["blp"] + mb["lr"]).requires_grad_()
        extra = dict(keep_mask=keep) if name == "m2po" else {}
        loss, m = policy_loss(name, lp, mb["blp"], mb["adv"], mb["mask"], loss_agg_mode=agg,
                              num_tokens=num_tokens, num_seqs=num_seqs, **extra)
        loss.backward()
        grads.append(lp.grad.reshape(-1))
        losses.append(loss.detach())
        metrics.append(m)
    got_grad = torch.cat(grads)
    check(torch.allclose(got_grad, ref_lp.grad[span], rtol=1e-6, atol=1e-9),
          f"rank {rank}: gradient differs from the full-batch gradient")
    total = torch.stack(losses).sum().double()
    dist.all_reduce(total, group=group)
    check(abs(float(total) - ref_loss.item()) < 1e-5, f"rank {rank}: summed loss {float(total)} vs {ref_loss.item()}")
    red = all_reduce_metrics(reduce_metrics(metrics), group=group)
    for k in ("loss", "m2po/m2_before", "m2po/m2_after", "m2po/masked_frac", "m2po/num_trust_region", "clip_frac",
              "ratio/mean", "ratio/min", "ratio/max", "kl/k1", "kl/k3", "count/tokens", "count/seqs"):
        check(abs(red[k] - ref_metrics[k]) <= 1e-5 * max(1.0, abs(ref_metrics[k])), f"rank {rank}: metric {k}: {red[k]} vs {ref_metrics[k]}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int)
    p.add_argument("--port", type=int)
    p.add_argument("--replicas", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=60))
    dp = a.world // a.replicas
    # Every rank creates every group, in the same order. DP group d' = ranks with the same replica index.
    groups = [dist.new_group([d * a.replicas + rep for d in range(dp)]) for rep in range(a.replicas)]
    group = groups[a.rank % a.replicas]
    dp_rank = a.rank // a.replicas

    try:
        global_m2po_keep_masks(torch.zeros(2), torch.zeros(2), torch.ones(2, dtype=torch.bool))
        raise AssertionError("group=None with several ranks must raise")
    except ValueError as e:
        check("data-parallel group" in str(e), str(e))

    cases = [
        ("m2po", "remove", "token-mean", "minibatch"),
        ("m2po", "cap", "token-mean", "minibatch"),
        ("m2po", "remove", "seq-mean-token-mean", "minibatch"),
        ("m2po", "remove", "seq-mean-token-sum", "minibatch"),
        ("m2po", "remove", "token-mean", "microbatch"),
        ("grpo", "remove", "token-mean", "minibatch"),
        ("gspo", "remove", "seq-mean-token-mean", "minibatch"),
    ]
    for seed in (0, 1):
        for name, rule, agg, scope in cases:
            run_case(a.rank, group, dp_rank, dp, seed, name, rule, agg, scope)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {a.rank} ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
