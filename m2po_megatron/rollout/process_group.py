"""A process group that joins a trainer rank and the rollout engines' ranks, outside the default group.

The trainer already lives in Megatron's default group (and a server process in none), so the weight-sync
group cannot come from `new_group` (which needs every default-group rank). Like SGLang's
`init_weights_update_group`, it is built from its own TCP store: rank 0 (the trainer) hosts the store at
master_address:master_port, the store is namespaced by the group name, and torch's process-group helper
builds a gloo or NCCL group over it. Both sides (our trainer and either SGLang or our CPU server) must build
it the same way so the store keys agree; this module is used by both of our sides."""
from __future__ import annotations

import datetime
import inspect

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def init_custom_process_group(*, backend: str, master_address: str, master_port: int, world_size: int,
                              rank: int, group_name: str, timeout_s: float = 600.0, store=None):
    """Blocks until all `world_size` ranks joined; returns a ProcessGroup usable as `group=` in
    torch.distributed collectives, where group rank == rank given here (0 = the trainer's source rank).
    `store`: rank 0's store already listening at master_address:master_port (net.serve_rendezvous), so the
    port cannot be taken between choosing and binding it; without it rank 0 binds master_port here."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the weight-sync group of world_size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store, rank, world_size = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank,
                                                       world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    # The options keyword was renamed across torch versions (pg_options -> backend_options).
    params = inspect.signature(c10d._new_process_group_helper).parameters
    opt_kw = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                           group_name=group_name, timeout=timeout, **{opt_kw: None})
    # Group rank i is "global" rank i for this group, so dist.broadcast(src=0, group=pg) works.
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_custom_process_group(pg) -> None:
    try:
        dist.destroy_process_group(pg)
    except Exception:  # a group whose peer died cannot always be torn down cleanly; drop our reference
        c10d._world.pg_group_ranks.pop(pg, None)
