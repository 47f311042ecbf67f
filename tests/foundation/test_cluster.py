"""The private local Ray: its resources, a trainer RankGroup forming a gloo group through rank 0's
rendezvous store, and the temp dir removed at shutdown."""
import os

import pytest

from m2po_megatron import cluster
from m2po_megatron.cluster import RankActorBase, RankGroup, init_ray, shutdown_ray


@pytest.mark.timeout(240)
def test_local_ray_rank_group_and_cleanup():
    import ray

    # every other in-process Ray in the suite is a function fixture that shuts down; one still up is a leak
    assert not ray.is_initialized(), "a Ray from an earlier test is still running in this process"

    class _Ranks(RankActorBase):  # defined here so Ray pickles it by value
        def all_reduce(self) -> tuple[int, int]:
            import datetime

            import torch
            import torch.distributed as dist

            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
            t = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(t)
            out = (dist.get_rank(), int(t.item()))
            dist.destroy_process_group()
            return out

    try:
        init_ray("local", num_cpus=2)
        tmp = cluster._owned_tmpdir
        assert tmp and os.path.isdir(tmp) and os.path.basename(tmp).startswith("m2po-ray-")
        res = ray.cluster_resources()
        assert res.get("trainer") == 1 and res.get("rollout") == 1
        group = RankGroup(_Ranks, 3)
        try:
            addr, port = group.master
            # every rank joined rank 0's store (bound before the port was handed out): sum of 1..3 everywhere
            assert sorted(group.call("all_reduce", timeout=120)) == [(0, 6), (1, 6), (2, 6)]
            assert port > 0 and addr
        finally:
            group.kill()
    finally:
        shutdown_ray()
    assert not os.path.exists(tmp) and cluster._owned_tmpdir is None
