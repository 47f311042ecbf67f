"""Routing replay's shape guards, in-process: a router's targets must be its own rows exactly (a one-row slice
would broadcast over every token through torch.where), and a sequence-parallel share is an equal block."""
import pytest
import torch

from m2po_megatron.actor.routing_replay import layer_replay_class, sp_share


def _hook(target):
    """One layer's replay hook (a megatron-core RouterReplay) replaying `target` in a forward."""
    h = layer_replay_class()(num_experts=4, recompute=False)
    h.layer_number = 1
    h.target = target
    return h


def _own_topk(scores, topk, num_groups=None, group_topk=None):
    probs, idx = scores.topk(topk, dim=1)
    return probs, idx


def test_a_router_refuses_targets_of_another_row_count():
    scores = torch.randn(6, 4).softmax(1)
    ok = torch.tensor([[3, 2]] * 6, dtype=torch.int16)
    _, used = _hook(ok).get_replay_topk(scores, 2, default_compute_topk=_own_topk)
    assert used.tolist() == [[3, 2]] * 6  # the targets replace the router's own choice
    for bad in (ok[:1], ok[:3], torch.cat([ok, ok])):  # (1, k) would broadcast; the others fail differently
        with pytest.raises(RuntimeError, match=r"routing replay of layer 1: targets \(\d+, 2\) for a router that "
                                               r"sees \(6, 2\)"):
            _hook(bad).get_replay_topk(scores, 2, default_compute_topk=_own_topk)


def test_sequence_parallel_share_is_an_equal_block():
    rows = torch.arange(8).view(8, 1)
    assert sp_share(rows, 0, 1) is rows
    assert sp_share(rows, 1, 2).flatten().tolist() == [4, 5, 6, 7]
    assert sp_share(rows, 3, 4).flatten().tolist() == [6, 7]
    with pytest.raises(RuntimeError, match="6 tokens does not split over 4 sequence-parallel ranks"):
        sp_share(rows[:6], 0, 4)
