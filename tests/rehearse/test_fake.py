"""The rehearsal's fake world: the allocator model's bytes and peak, its kinds, the host-read and real-op seams,
and the collective log (m2po_megatron.infra.fake_world). No Megatron model here: small programs whose allocations
are known by hand."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from m2po_megatron.infra.fake_world import ALIGN, CollectiveLog, RehearsalMode, fake_world_rank, logged_collectives

MiB = 2**20


def test_peak_counts_live_storages_once_and_frees_them():
    mode = RehearsalMode()
    with mode:
        a = torch.empty(MiB, dtype=torch.float32)  # 4 MiB
        v = a.view(-1, 2)  # a view: no new block
        b = torch.empty(MiB, dtype=torch.bfloat16)  # 2 MiB
        assert mode.live_bytes() == 6 * MiB
        del b
        assert mode.live_bytes() == 4 * MiB
        c = a * 2  # 4 MiB more: peak 8 MiB (above the 6 of a + b)
        del c, v
    assert mode.peak == 8 * MiB
    assert mode.live_bytes() == 4 * MiB
    assert isinstance(a, torch._subclasses.fake_tensor.FakeTensor)


def test_blocks_round_up_to_the_allocator_alignment():
    mode = RehearsalMode()
    with mode:
        x = torch.empty(3, dtype=torch.float32)  # 12 bytes -> one 512-byte block
    assert mode.live_bytes() == ALIGN
    del x


def test_kinds_at_the_peak_follow_tags_and_saved_tensors():
    mode = RehearsalMode()
    with mode:
        mode.phase = "build"
        w = torch.empty(256, 256, requires_grad=True)  # 256 KiB
    mode.tag([w], "weights")
    mode.phase = "temporaries"
    with mode, mode.saved_as_activations():
        x = torch.empty(64, 256)
        h = x @ w  # saved: x (for w's grad) and w; h is the output, kept by the caller
        y = h.relu()  # saves its output
        loss = y.sum()
        loss.backward()
    kinds = mode.breakdown()
    assert kinds["weights"] == 256 * 256 * 4
    assert kinds["activations"] >= 2 * 64 * 256 * 4  # x and relu's output
    assert "temporaries" in kinds  # h, the backward's gradients
    assert sum(kinds.values()) <= mode.peak * (1 + mode.PEAK_STEP) and sum(kinds.values()) >= mode.peak * 0.99


def test_host_reads_return_zero_and_data_dependent_shapes_their_bound():
    mode = RehearsalMode()
    with mode:
        t = torch.empty(5)
        assert t.sum().item() == 0.0
        assert bool(torch.isnan(t).any()) is False
        assert torch.nonzero(t > 0).shape == (5, 1)


def test_ops_on_real_tensors_stay_real():
    real = torch.tensor([1.0, float("nan"), 3.0])
    mode = RehearsalMode()
    with mode:
        finite = torch.isfinite(real)
        assert not isinstance(finite, torch._subclasses.fake_tensor.FakeTensor)
        assert finite.tolist() == [True, False, True]  # read for real: a real batch's checks still catch it
        mixed = torch.empty(3) + real  # touches a fake tensor: fake
        assert isinstance(mixed, torch._subclasses.fake_tensor.FakeTensor)


def test_fake_world_rank_is_megatrons_order():
    assert fake_world_rank(0, tp=4, dp=2) == 0
    assert fake_world_rank(1, tp=8, dp=1) == 8
    assert fake_world_rank(3, tp=2, dp=4) == 24


@pytest.fixture()
def fake_world():
    from m2po_megatron.infra.fake_world import close_fake_world, init_fake_world

    new_group = dist.new_group
    init_fake_world(rank=2, world_size=4)
    yield
    close_fake_world()
    assert dist.new_group is new_group and not dist.is_initialized()  # nothing left for the next test


@pytest.mark.timeout(60)
def test_collectives_are_logged_with_group_and_bytes(fake_world):
    log = CollectiveLog()
    sub = dist.new_group([0, 2], backend="gloo")  # gloo is asked for; the fake world builds a fake group
    log.names[sub] = "dp"
    t = torch.zeros(1024, dtype=torch.bfloat16)
    with logged_collectives(log):
        dist.all_reduce(t, group=sub)
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        box = [None]
        dist.broadcast_object_list(box, src=0, group=sub)
        objs = [None] * 4
        dist.all_gather_object(objs, {"k": 1})
        ops = [dist.P2POp(dist.isend, t, 3), dist.P2POp(dist.irecv, t, 1)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    calls = [(c, g, n) for c, g, n in log.calls]
    assert calls[0] == ("all_reduce", "dp", 2048)
    assert calls[1] == ("all_reduce", "world", 2048)
    assert box == [{}] and objs == [{"k": 1}] * 4
    assert [c for c, _, _ in calls[-2:]] == ["isend", "irecv"]
    summary = {(s["call"], s["group"]): s for s in log.summary()}
    assert summary[("all_reduce", "dp")]["count"] == 1 and summary[("isend", "world")]["bytes"] == 2048
    # outside the block the real functions are back
    assert dist.all_reduce.__module__ == "torch.distributed.distributed_c10d"


def test_balanced_moe_routing_gives_every_expert_its_share():
    """The rehearsal's MoE seam: k distinct experts per token and T x k / E tokens per expert (rounded), so the
    dispatcher's split sizes are real numbers."""
    from m2po_megatron.infra.fake_world import balanced_routing_map

    for tokens, experts, k in ((16, 4, 2), (1000, 128, 8), (7, 8, 3)):
        m = balanced_routing_map(tokens, experts, k)
        assert m.shape == (tokens, experts) and m.dtype == torch.bool
        assert (m.sum(1) == k).all()  # k distinct experts per token
        per = m.sum(0)
        assert int(per.sum()) == tokens * k and int(per.max() - per.min()) <= 1  # balanced
