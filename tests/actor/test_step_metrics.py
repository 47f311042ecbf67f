"""The actor's step metrics (actor.metrics): a mini-batch's micro-batches reduce exactly as algo.reduce_metrics
does (the one implementation), plus the actor's own keys; a step's updates combine as docs/actor.md says."""
import pytest
import torch

from m2po_megatron.actor.metrics import combine_updates, reduce_minibatch
from m2po_megatron.algo import policy_loss, reduce_metrics


def _micro_batches(n_mb=3):
    torch.manual_seed(1)
    lp = torch.randn(9, 7) * 0.3
    blp = torch.zeros(9, 7)
    adv = torch.randn(9, 1).expand(9, 7)
    mask = torch.rand(9, 7) > 0.3
    n = int(mask.sum())
    rows = torch.arange(9).chunk(n_mb)
    return [policy_loss("m2po", lp[r], blp[r], adv[r], mask[r], num_tokens=n, num_seqs=9)[1] for r in rows], n


def test_one_rank_reduces_micro_batches_as_algo_does_plus_entropy_and_counts():
    parts, n = _micro_batches()
    out = reduce_minibatch(parts, entropy_sum=2.5 * n, mask_stats={"m2po_global/num_dropped": 4}, dp_group=None)
    ref = reduce_metrics(parts)
    assert {k: out[k] for k in ref} == ref  # bit-identical: the same partials, one division at the end
    assert out["count/tokens"] == n
    assert out["entropy"] == pytest.approx(2.5)
    assert out["num_microbatches"] == 3
    assert out["m2po_global/num_dropped"] == 4


def test_updates_of_a_step_sum_counts_keep_extremes_and_the_last_lr():
    a = {"loss": 1.0, "num_tokens": 10, "ratio/max": 1.5, "ratio/min": 0.5, "lr": 1e-3, "update_successful": True}
    b = {"loss": 3.0, "num_tokens": 20, "ratio/max": 1.2, "ratio/min": 0.4, "lr": 2e-3, "update_successful": False}
    out = combine_updates([a, b], updates_applied=7)
    assert (out["loss"], out["num_tokens"], out["ratio/max"], out["ratio/min"], out["lr"]) == (2.0, 30, 1.5, 0.4, 2e-3)
    assert (out["num_updates"], out["updates_applied_total"], out["per_update"]) == (1, 7, [a, b])
    assert "update_successful" not in out


def test_one_read_per_update_gives_the_per_micro_batch_floats():
    """read_step_values (the actor's one read after the schedule) returns the dicts policy_loss returns call
    by call, and the entropy sum of per-micro-batch float() reads, so reduce_minibatch stays bit-identical."""
    from m2po_megatron.actor.metrics import read_step_values
    from m2po_megatron.algo import policy_loss_on_device

    torch.manual_seed(2)
    lp, blp = torch.randn(9, 7) * 0.3, torch.zeros(9, 7)
    adv, mask = torch.randn(9, 1).expand(9, 7), torch.rand(9, 7) > 0.3
    ent = [torch.rand(5) for _ in range(3)]
    rows = torch.arange(9).chunk(3)
    stats = [policy_loss_on_device("m2po", lp[r], blp[r], adv[r], mask[r], num_tokens=40, num_seqs=9)[1] for r in rows]
    got, ent_sum = read_step_values(stats, [e.sum() for e in ent])
    assert got == [policy_loss("m2po", lp[r], blp[r], adv[r], mask[r], num_tokens=40, num_seqs=9)[1] for r in rows]
    ref = 0.0
    for e in ent:
        ref += float(e.sum())
    assert ent_sum == ref
