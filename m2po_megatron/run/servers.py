"""The run's rollout servers from the driver: a fixed port checked before anything starts, the servers
launched on the `rollout` nodes (or attached to), where they run recorded, and the client that talks to them."""
from __future__ import annotations

import uuid
from pathlib import Path

from omegaconf import DictConfig

from m2po_megatron.config import secret
from m2po_megatron.run.rundir import record_placement


def api_key(cfg: DictConfig) -> str | None:
    """The servers' API key: $M2PO_API_KEY, else rollout.api_key."""
    return secret(cfg.rollout.api_key, "M2PO_API_KEY")


def check_ports(cfg: DictConfig) -> None:
    """A fixed rollout.port on this machine must be free now (port 0, the default, always is)."""
    import socket

    from m2po_megatron.config import ConfigError

    r = cfg.rollout
    if r.urls or not r.port or not r.host or cfg.cluster.ray_address != "local":
        return
    for port in range(r.port, r.port + r.num_servers):
        with socket.socket(socket.AF_INET6 if ":" in r.host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((r.host, port))
            except OSError as e:
                raise ConfigError(f"rollout.port = {r.port}: port {port} on {r.host} is in use ({e.strerror}); use "
                                  f"rollout.port=0 (each server binds a free port) or another port") from None


def start_rollout_engines(cfg: DictConfig, rdir: Path, trainers=None):
    """Launch the servers as Ray actors on the `rollout` nodes (SGLang on GPUs, our CPU server otherwise),
    or attach to rollout.urls; colocated, in the bundles of `trainers` (`colocated_engines`). Returns
    (manager or None, urls)."""
    import ray

    from m2po_megatron.infra.cluster import ROLLOUT_RESOURCE
    from m2po_megatron.rollout.groups import routing_spec
    from m2po_megatron.rollout.launcher import EngineManager

    r = cfg.rollout
    key = api_key(cfg)
    if r.urls:  # never colocated (validation refuses rollout.urls with cluster.colocate)
        urls = EngineManager.attach(list(r.urls), api_key=key, timeout_s=r.health_timeout_s)
        if routing_spec(cfg) is not None:  # R3: SGLang's recorded expert ids must be the model's
            from m2po_megatron.config import ConfigError
            from m2po_megatron.rollout.launcher import physical_routing_servers

            refusal = physical_routing_servers(urls, key)
            if refusal:
                raise ConfigError(refusal)
        return None, urls
    if cfg.cluster.colocate:
        return colocated_engines(cfg, rdir, trainers)
    from m2po_megatron.infra.errors import RunError

    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get(ROLLOUT_RESOURCE)]
    if not nodes:
        raise RunError(f"no Ray node offers the '{ROLLOUT_RESOURCE}' resource for rollout servers; start "
                       f"rollout nodes with --resources='{{\"{ROLLOUT_RESOURCE}\": N}}' (slurm/ does)")
    identity, specs = server_specs(cfg)
    pinned = [nodes[i % len(nodes)] for i in range(r.num_servers)]
    mgr = EngineManager(specs, run_dir=str(rdir), use_ray=True, max_restarts=r.max_restarts,
                        health_timeout_s=r.health_timeout_s, node_ids=pinned,
                        num_cpus_per_server=0, env=server_env(cfg, rdir))
    urls = mgr.start()
    by_id = {n["NodeID"]: n for n in ray.nodes()}
    placed = [{"server": i, "node": by_id[nid]["NodeManagerHostname"], "ip": by_id[nid]["NodeManagerAddress"],
               "url": url, "pid": info["pid"], "actor_pid": info["actor_pid"], "identity": identity}
              for i, (nid, url, info) in enumerate(zip(pinned, urls, mgr.info()))]
    record_placement(rdir, "rollout", placed)
    return mgr, urls


def server_specs(cfg: DictConfig, extra_args: tuple[str, ...] = ()) -> tuple[str, list]:
    """(the run's identity, one ServerSpec per server). Each server carries the identity; the launcher checks
    it before the run uses a server, so a run never talks to another run's server. Port 0: the launcher binds
    a free port itself."""
    from m2po_megatron.rollout.groups import routing_spec
    from m2po_megatron.rollout.launcher import ServerSpec

    r = cfg.rollout
    identity = f"m2po-{uuid.uuid4().hex[:12]}"
    return identity, [
        ServerSpec(model_path=str(Path(cfg.model.hf_path).resolve()), engine=r.engine, host=r.host or "auto",
                   port=r.port + i if r.port else 0, tp_size=r.tp_size, dp_size=r.dp_size,
                   mem_fraction_static=r.mem_fraction_static, context_length=r.context_length,
                   dtype=r.dtype, quantization=r.quantization, api_key=api_key(cfg),
                   random_seed=cfg.run.seed + i, weight_version="0", served_model_name=identity,
                   enable_deterministic_inference=r.deterministic_inference,
                   enable_return_routed_experts=routing_spec(cfg) is not None, extra_args=extra_args)
        for i in range(r.num_servers)]


# Colocated on a GPU, a trainer rank's bundle holds one GPU: the rank's actor takes TRAINER_GPU_SHARE of it and
# the engine's actor, in the bundle of the engine's first rank, the rest (as slime's colocated placement shares
# a bundle's GPU between its actors). Ray's fractions are bookkeeping: the memory is shared in time, by the swap.
TRAINER_GPU_SHARE = 0.5


def colocated_engines(cfg: DictConfig, rdir: Path, trainers):
    """One engine per rollout.tp_size x dp_size consecutive trainer ranks, its Ray actor in the bundle of the
    first of them (on CPU taking only the `rollout` share of it; on a GPU the rest of its GPU), its server on
    those ranks' GPUs (CUDA_VISIBLE_DEVICES = their Ray GPU ids, which the ranks report). SGLang starts with
    --enable-memory-saver: its release and resume of memory occupation need it."""
    from m2po_megatron.infra.cluster import ROLLOUT_RESOURCE
    from m2po_megatron.rollout.launcher import EngineManager

    r = cfg.rollout
    k = r.tp_size * r.dp_size  # trainer ranks (GPUs, CPU slots) per engine; validation: num_servers x k = world
    gpu = cfg.cluster.gpus_per_node > 0
    identity, specs = server_specs(cfg, ("--enable-memory-saver",) if r.engine == "sglang" else ())
    nodes = trainers.nodes
    envs = [{"CUDA_VISIBLE_DEVICES": ",".join(g for n in nodes[i * k:(i + 1) * k] for g in n["gpu_ids"])}
            if gpu else {} for i in range(r.num_servers)]
    mgr = EngineManager(specs, run_dir=str(rdir), use_ray=True, max_restarts=r.max_restarts,
                        health_timeout_s=r.health_timeout_s, num_cpus_per_server=0,
                        num_gpus_per_server=1 - TRAINER_GPU_SHARE if gpu else 0, env=server_env(cfg, rdir),
                        bundles=[trainers.group.bundle(i * k) for i in range(r.num_servers)], server_envs=envs,
                        resources={ROLLOUT_RESOURCE: 1e-3})
    urls = mgr.start()
    placed = [{"server": i, "node": nodes[i * k]["hostname"], "ip": nodes[i * k]["ip"], "url": url, "pid": info["pid"],
               "actor_pid": info["actor_pid"], "identity": identity, "colocated_with_ranks": list(range(i * k,
                                                                                                     (i + 1) * k))}
              for i, (url, info) in enumerate(zip(urls, mgr.info()))]
    record_placement(rdir, "rollout", placed)
    return mgr, urls


def server_env(cfg: DictConfig, rdir: Path) -> dict:
    """The servers' environment: one OpenMP thread, and the run's timeline for the CPU engine's spans."""
    from m2po_megatron.infra.trace import trace_env

    env = {"OMP_NUM_THREADS": "1"}
    if cfg.logging.trace:
        env.update(trace_env(rdir, cfg.logging.trace_limit))
    return env


def make_client(cfg: DictConfig, urls: list[str]):
    from m2po_megatron.rollout.client import SyncRolloutClient

    r = cfg.rollout
    return SyncRolloutClient(urls, api_key=api_key(cfg),
                             max_concurrency_per_server=r.max_concurrency, request_timeout_s=r.request_timeout_s,
                             max_retries=r.max_retries)
