"""Ray across the nodes, placed as the recipe asks: the nodes offering the `trainer` and `rollout` resources
(slurm/ray_node.sh tags them) against cluster.trainer_nodes and rollout_nodes, the trainer ranks in the
placement groups the run builds (infra.cluster.RankGroup, as run/trainers.py calls it) and one probe per
rollout server with the resources and node pinning run/servers.py gives it. Nothing is computed: each probe
reports where it landed."""
from __future__ import annotations

from m2po_megatron.infra.cluster import ROLLOUT_RESOURCE, TRAINER_RESOURCE, RankActorBase
from m2po_megatron.preflight.checks import CheckFailed, connect_ray

NODES_FIX = ("start the job with `sbatch -N <trainer_nodes + rollout_nodes>` (slurm/preflight.sbatch checks it) and "
             "see RUN_DIR/logs/ray-*.log for a node that did not join")


class Probe(RankActorBase):
    """A trainer rank's stand-in: placed like one, it only says where it is (RankActorBase.node)."""


def _alive_with(ray, resource: str) -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive") and n["Resources"].get(resource, 0) > 0]


def run(cfg, ctx: dict) -> dict:
    from m2po_megatron.infra.cluster import PlacementTimeout, RankGroup
    from m2po_megatron.run.servers import TRAINER_GPU_SHARE

    ray = connect_ray(ctx)
    c, p, r = cfg.cluster, cfg.parallel, cfg.rollout
    local = ctx.get("local_ray", False)
    trainer_nodes, rollout_nodes = _alive_with(ray, TRAINER_RESOURCE), _alive_with(ray, ROLLOUT_RESOURCE)
    numbers = {"nodes": sum(1 for n in ray.nodes() if n.get("Alive")), "trainer_nodes": len(trainer_nodes),
               "rollout_nodes": len(rollout_nodes)}
    want_t = 1 if local else c.trainer_nodes
    want_r = 1 if local or c.rollout_nodes == 0 else c.rollout_nodes
    if len(trainer_nodes) < want_t or len(rollout_nodes) < want_r:
        raise CheckFailed(f"{len(trainer_nodes)} Ray node(s) offer '{TRAINER_RESOURCE}' and {len(rollout_nodes)} "
                          f"'{ROLLOUT_RESOURCE}'; the recipe asks {c.trainer_nodes} trainer and {c.rollout_nodes} "
                          "rollout node(s)", NODES_FIX, numbers)
    world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size \
        * p.data_parallel_size
    gpus = c.trainer_gpus_per_node or c.gpus_per_node
    share = TRAINER_GPU_SHARE if c.colocate else 1
    try:
        group = RankGroup(Probe, world, gpus_per_rank=share if gpus else 0, ranks_per_node=gpus or None,
                          placement_timeout_s=max(10.0, ctx["limit_s"] / 3), timeout_s=ctx["limit_s"] / 3,
                          shared_with=ROLLOUT_RESOURCE if c.colocate else None)
    except PlacementTimeout as e:
        raise CheckFailed(f"the trainer ranks cannot be placed: {e}",
                          "give the job the nodes and GPUs the recipe's layout needs (cluster.gpus_per_node, "
                          "parallel.*), or change the layout; `m2po plan` proposes one that fits", numbers) from None
    try:
        placed = group.call("node", timeout=ctx["limit_s"] / 3)
    finally:
        group.kill()
    hosts: dict[str, int] = {}
    for n in placed:
        hosts[n["hostname"]] = hosts.get(n["hostname"], 0) + 1
    if gpus and any(len(n["gpu_ids"]) != 1 for n in placed):
        raise CheckFailed(f"a trainer rank holds GPUs {[n['gpu_ids'] for n in placed]}, not exactly one",
                          "start Ray with the node's GPUs (ray_node.sh counts CUDA_VISIBLE_DEVICES or nvidia-smi)",
                          numbers)
    numbers.update(trainer_ranks=world, trainer_hosts=len(hosts), ranks_per_host=max(hosts.values()))
    if not c.colocate and not r.urls:
        numbers["servers_placed"] = _place_servers(ray, cfg, rollout_nodes, ctx["limit_s"] / 3)
    return numbers


def _place_servers(ray, cfg, rollout_nodes: list[dict], timeout_s: float) -> int:
    """One probe per rollout server with the resources EngineManager's actor asks for, pinned round-robin to the
    rollout nodes as run/servers.py pins them."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    r = cfg.rollout
    gpus = r.tp_size * r.dp_size if r.engine == "sglang" else 0

    @ray.remote(num_cpus=0)
    class ServerProbe:
        def where(self) -> str:
            import socket

            return socket.gethostname()

    actors = [ServerProbe.options(num_gpus=gpus, scheduling_strategy=NodeAffinitySchedulingStrategy(
        rollout_nodes[i % len(rollout_nodes)]["NodeID"], soft=False)).remote() for i in range(r.num_servers)]
    try:
        ray.get([a.where.remote() for a in actors], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise CheckFailed(f"{r.num_servers} rollout server(s) of {gpus} GPU(s) each cannot be placed on the "
                          f"{len(rollout_nodes)} rollout node(s) within {timeout_s:.0f} s",
                          "give the rollout nodes enough GPUs for rollout.num_servers x rollout.tp_size, or lower "
                          "them", {"rollout_nodes": len(rollout_nodes)}) from None
    finally:
        for a in actors:
            ray.kill(a)
    return len(actors)
