"""Ray placement: start or join Ray, and run a group of trainer ranks as Ray actors. No business logic.

Nodes are told apart by Ray custom resources: `trainer` on nodes that host Megatron ranks and `rollout` on
nodes that host rollout servers (the Slurm scripts tag nodes with them; a local run tags its one node with
both). Placing by resource keeps trainer ranks and rollout servers on separate nodes when the cluster has
them, without the driver knowing node names.
"""
from __future__ import annotations

import os
import socket
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from m2po_megatron.infra.net import serve_rendezvous

TRAINER_RESOURCE = "trainer"
ROLLOUT_RESOURCE = "rollout"


def node_ip() -> str:
    """This node's address for servers and rendezvous (never 0.0.0.0)."""
    import ray

    try:
        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray
        return "127.0.0.1"


_owned_tmpdir: Optional[str] = None  # the private temp dir init_ray made
_reaper = None  # reaper.Reaper: reclaims the run's processes when this driver ends, however it ends


def init_ray(address: str = "local", *, tmpdir: Optional[str] = None, object_store_memory_mb: int = 512,
             trainer_slots: int = 1, rollout_slots: int = 1, num_cpus: Optional[int] = None) -> dict:
    """Start a private local Ray (address="local": own temp dir, never another user's cluster) or join
    one ("auto" or HOST:PORT, e.g. the Slurm job's head). Returns ray.init's context info."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a stale ~/.ray/auth_token breaks local workers
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return {}
    from m2po_megatron.infra import reaper

    global _owned_tmpdir, _reaper
    token = reaper.new_token()  # inherited by every process started from here on (reaper.py)
    if address == "local":
        reaper.clean_stale()  # private temp dirs (and processes) of drivers that were killed
        tmp = tmpdir or tempfile.mkdtemp(prefix=reaper.PREFIX)
        _owned_tmpdir = None if tmpdir else tmp  # ours to delete at shutdown (the run dir keeps the logs)
        Path(tmp).mkdir(parents=True, exist_ok=True)
        reaper.write_owner(tmp, token, owned=tmpdir is None)
        _reaper = reaper.Reaper(token, str(Path(tmp).resolve()), delete_tmpdir=tmpdir is None)
        ctx = ray.init(
            address="local", _temp_dir=str(Path(tmp).resolve()), include_dashboard=False,
            object_store_memory=object_store_memory_mb * 1024 * 1024,
            resources={TRAINER_RESOURCE: trainer_slots, ROLLOUT_RESOURCE: rollout_slots},
            num_cpus=num_cpus if num_cpus is not None else max(4, os.cpu_count() or 1),
            log_to_driver=True, configure_logging=False,
        )
    else:
        _reaper = reaper.Reaper(token, None, delete_tmpdir=False)  # this node's processes (reward workers)
        ctx = ray.init(address=address, log_to_driver=True)
    return {"address": getattr(ctx, "address_info", {}).get("address", address)}


def shutdown_ray() -> None:
    global _owned_tmpdir, _reaper
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if _reaper is not None:  # sweeps what ray.shutdown left (its agents exit late) and waits for that
        _reaper.close()
        _reaper = None
        from m2po_megatron.infra.reaper import TOKEN_ENV

        os.environ.pop(TOKEN_ENV, None)  # processes started from now on are not this run's
    if _owned_tmpdir is not None:
        shutil.rmtree(_owned_tmpdir, ignore_errors=True)
        _owned_tmpdir = None


def rank_bundles(world_size: int, ranks_per_node: Optional[int] = None, gpus_per_rank: float = 0,
                 resource: str = TRAINER_RESOURCE, shared_with: Optional[str] = None) -> list[list[dict]]:
    """Placement-group bundles for `world_size` ranks: one group per node of `ranks_per_node` consecutive
    ranks (rank r is bundle r % n of group r // n), so a node holds whole tensor-parallel groups whenever n
    is a multiple of the TP size (Megatron's TP groups are consecutive ranks). None: one group of all ranks.
    `shared_with`: a second role's resource in every bundle (colocation: the rollout engines sit in the
    trainer ranks' bundles, and a bundle with a GPU holds one whole GPU that both use)."""
    n = ranks_per_node or world_size
    if world_size < 1 or n < 1 or world_size % n:
        raise ValueError(f"world size {world_size} is not a multiple of ranks_per_node {n}: every trainer node "
                         f"holds the same number of ranks (cluster.gpus_per_node)")
    bundle = {resource: 1e-3}
    if shared_with:
        bundle[shared_with] = 1e-3
        gpus_per_rank = 1 if gpus_per_rank else 0
    if gpus_per_rank:
        bundle["GPU"] = gpus_per_rank
    return [[dict(bundle) for _ in range(n)] for _ in range(world_size // n)]


class PlacementTimeout(RuntimeError):
    """Ray could not place a RankGroup's placement groups in time (the message says what they need)."""


class RankGroup:
    """`world_size` Ray actors of `actor_cls`, one per rank, on nodes with the `trainer` resource.

    Ranks are placed with placement groups (rank_bundles): with `ranks_per_node` (GPU runs: the node's GPU
    count), one STRICT_PACK group per node of consecutive ranks, as verl places its worker groups; else one
    PACK group. Rank 0 is created first and hosts the rendezvous store (its node's IP, a port bound at once), so
    the group works across nodes; every rank gets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as torchrun would
    set them, and LOCAL_RANK = the index of the GPU Ray assigned it (device.local_gpu_index).
    `call(method, ...)` runs a method on every rank and returns all results."""

    def __init__(self, actor_cls: Any, world_size: int, *, gpus_per_rank: float = 0, env: Optional[dict] = None,
                 resource: str = TRAINER_RESOURCE, init_kwargs: Optional[dict] = None,
                 ranks_per_node: Optional[int] = None, placement_timeout_s: float = 600.0,
                 timeout_s: Optional[float] = None, shared_with: Optional[str] = None):
        """shared_with: see rank_bundles; each rank then takes `gpus_per_rank` (a fraction) of its bundle's GPU
        and the other role's actors the rest (`bundle(rank)`)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        groups = rank_bundles(world_size, ranks_per_node, gpus_per_rank, resource, shared_with)
        strategy = "STRICT_PACK" if ranks_per_node else "PACK"
        self.placement_groups = [placement_group(b, strategy=strategy) for b in groups]
        self.world_size = world_size
        self.actors = []
        try:
            ray.get([pg.ready() for pg in self.placement_groups], timeout=placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            for pg in self.placement_groups:
                remove_placement_group(pg)
            raise PlacementTimeout(
                f"Ray could not place {world_size} trainer ranks within {placement_timeout_s:.0f} s: they need "
                f"{len(groups)} node(s) each offering {len(groups[0])} x {groups[0][0]} ({strategy}); the cluster "
                f"has {ray.available_resources()}") from None
        remote_cls = ray.remote(actor_cls)
        n = len(groups[0])
        self.ranks_per_group = n

        def opts(rank: int) -> dict:
            return dict(num_cpus=0, num_gpus=gpus_per_rank, resources={resource: 1e-3},
                        runtime_env={"env_vars": {k: str(v) for k, v in (env or {}).items()}},
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=self.placement_groups[rank // n],
                            placement_group_bundle_index=rank % n))

        rank0 = remote_cls.options(**opts(0)).remote(**(init_kwargs or {}))
        master_addr, master_port = ray.get(rank0.rendezvous_address.remote(), timeout=timeout_s)
        self.master = (master_addr, master_port)
        self.actors.append(rank0)
        for rank in range(1, world_size):
            self.actors.append(remote_cls.options(**opts(rank)).remote(**(init_kwargs or {})))
        ray.get([a.set_dist_env.remote(rank, world_size, master_addr, master_port)
                 for rank, a in enumerate(self.actors)], timeout=timeout_s)

    def bundle(self, rank: int):
        """(placement group, bundle index) of `rank`: where another role's actor shares its resources."""
        return self.placement_groups[rank // self.ranks_per_group], rank % self.ranks_per_group

    def call_async(self, method: str, *args, **kwargs) -> list:
        return [getattr(a, method).remote(*args, **kwargs) for a in self.actors]

    def call(self, method: str, *args, timeout: Optional[float] = None, **kwargs) -> list:
        import ray

        return ray.get(self.call_async(method, *args, **kwargs), timeout=timeout)

    def kill(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:
                pass
        for pg in getattr(self, "placement_groups", []):
            try:
                remove_placement_group(pg)
            except Exception:
                pass


def assigned_gpu_ids() -> list:
    """The GPU ids Ray assigned to this worker ([] outside Ray or without GPUs)."""
    import ray

    return list(ray.get_gpu_ids()) if ray.is_initialized() else []


class RankActorBase:
    """Mixin for Ray actors that form a torch.distributed group (see RankGroup)."""

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0 hosts the group's rendezvous store on its node (see net.serve_rendezvous)."""
        ip = node_ip()
        self._rendezvous = serve_rendezvous(ip)
        return ip, self._rendezvous.port

    def set_dist_env(self, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        from m2po_megatron.infra.device import local_gpu_index

        local = local_gpu_index(assigned_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local),
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
                          TORCHELASTIC_USE_AGENT_STORE="True")  # every rank a client of rank 0's store
        self.rank = rank

    def node(self) -> dict:
        return {"rank": getattr(self, "rank", None), "hostname": socket.gethostname(), "ip": node_ip(),
                "pid": os.getpid(), "gpu_ids": [str(i) for i in assigned_gpu_ids()]}

    def run(self, fn: Callable, *args, **kwargs):
        """Run an arbitrary picklable function in this rank (tests, diagnostics)."""
        return fn(*args, **kwargs)
