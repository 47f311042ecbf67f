"""The private local Ray: its resources, a trainer RankGroup forming a gloo group through rank 0's
rendezvous store, and the temp dir removed at shutdown."""
import os

import pytest

from m2po_megatron.infra import cluster
from m2po_megatron.infra.cluster import RankActorBase, RankGroup, init_ray, shutdown_ray


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


def test_rank_bundles_keep_consecutive_ranks_on_one_node():
    from m2po_megatron.infra.cluster import rank_bundles

    groups = rank_bundles(16, ranks_per_node=8, gpus_per_rank=1)
    assert [len(g) for g in groups] == [8, 8] and groups[0][0] == {"trainer": 1e-3, "GPU": 1}
    assert rank_bundles(3) == [[{"trainer": 1e-3}] * 3]  # CPU: one group, no GPU
    with pytest.raises(ValueError, match="ranks_per_node"):
        rank_bundles(12, ranks_per_node=8, gpus_per_rank=1)


@pytest.mark.parametrize("ray_ids, visible, expected", [
    ([3], "3", 0),                 # Ray's usual case: the process sees only its own GPU
    (["5"], "4,5,6,7", 1),          # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: position in the visible list
    ([2], None, 2),                # nothing set: the id is the index
    (["GPU-aa"], "GPU-bb,GPU-aa", 1),  # UUIDs
    ([], "0,1", 5),                # not under Ray (torchrun): LOCAL_RANK as given
])
def test_local_gpu_index_from_ray_assignment(ray_ids, visible, expected):
    from m2po_megatron.infra.device import local_gpu_index

    assert local_gpu_index(ray_ids, visible, local_rank=5) == expected


def test_local_gpu_index_refuses_impossible_assignments():
    from m2po_megatron.infra.device import local_gpu_index

    with pytest.raises(ValueError, match="not in CUDA_VISIBLE_DEVICES"):
        local_gpu_index([3], "0,1")
    with pytest.raises(ValueError, match="exactly one GPU"):
        local_gpu_index([0, 1], "0,1")


@pytest.mark.timeout(240)
def test_gpu_ranks_get_their_own_device_and_whole_nodes():
    """A real local Ray that advertises 4 GPUs (Ray assigns ids and sets CUDA_VISIBLE_DEVICES itself; no GPU
    is touched): 4 ranks at 2 per node-group. Every rank's LOCAL_RANK points at the GPU Ray gave it (the old
    LOCAL_RANK = global rank pointed ranks 1-3 at devices their process cannot see), and ranks {0,1} and
    {2,3} share a placement group each."""
    import ray

    assert not ray.is_initialized(), "a Ray from an earlier test is still running in this process"

    class _Ranks(RankActorBase):
        def where(self):
            pg = ray.util.get_current_placement_group()
            return (int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), os.environ["CUDA_VISIBLE_DEVICES"],
                    [str(i) for i in ray.get_gpu_ids()], pg.id.hex() if pg else None)

    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="m2po-ray-")  # short: Ray's socket paths must stay under 108 bytes
    ray.init(address="local", num_cpus=2, num_gpus=4, resources={"trainer": 4}, include_dashboard=False,
             object_store_memory=128 * 1024 * 1024, _temp_dir=tmp)
    try:
        group = RankGroup(_Ranks, 4, gpus_per_rank=1, ranks_per_node=2)
        try:
            out = sorted(group.call("where", timeout=120))
        finally:
            group.kill()
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    assert [o[0] for o in out] == [0, 1, 2, 3]
    assert len({o[2] for o in out}) == 4  # four distinct GPUs
    for rank, local, visible, ids, _ in out:
        assert visible.split(",")[local] == ids[0], (rank, local, visible, ids)
    assert out[0][4] == out[1][4] != out[2][4] == out[3][4]


def test_a_gpu_index_the_process_cannot_see_is_refused():
    """torch.cuda.set_device accepts a missing index silently (the first H200 run); select_gpu does not."""
    import torch

    from m2po_megatron.infra.device import select_gpu

    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs; the index check is exercised where there are none")
    with pytest.raises(RuntimeError, match="LOCAL_RANK=1 but this process sees 0 GPU"):
        select_gpu(1)
