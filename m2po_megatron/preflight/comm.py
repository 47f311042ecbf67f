"""All-reduce and broadcast bandwidth over the default backend (infra.device.dist_backend: NCCL on GPUs, gloo
on CPU), one rank per GPU of every node of the allocation (on CPU two ranks on this node), as Ray actors that
form a torch.distributed group the way the trainer's ranks do (infra.cluster.RankActorBase). The bus bandwidth
(nccl-tests' busbw: all-reduce moves 2(n-1)/n of the buffer per rank) is compared with the link figure the
planner assumes (plan/hardware.py): InfiniBand per GPU across nodes, NVLink within one."""
from __future__ import annotations

import os
import time

from m2po_megatron.infra.cluster import RankActorBase
from m2po_megatron.preflight.checks import CheckFailed, CheckSkipped, cluster_has_gpus, connect_ray

CPU_BYTES, GPU_BYTES = 8 << 20, 256 << 20
ITERS = 5
MIN_OF_FIGURE = 0.25  # below a quarter of the datasheet's link: not the fast network (the planner assumes half)


class CommRank(RankActorBase):
    def measure(self, backend: str, nbytes: int, iters: int, timeout_s: float) -> dict:
        import datetime
        import socket

        import torch
        import torch.distributed as dist

        dev = torch.device("cpu")
        name = None
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            dev, name = torch.device("cuda", torch.cuda.current_device()), torch.cuda.get_device_name()
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        try:
            buf = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)

            def timed(op) -> float:
                op()  # warm-up: the communicator's set-up is not bandwidth
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    op()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                return (time.perf_counter() - t0) / iters

            ar = timed(lambda: dist.all_reduce(buf))
            bc = timed(lambda: dist.broadcast(buf, src=0))
            ok = bool(torch.isfinite(buf).all())
        finally:
            dist.destroy_process_group()
        return {"all_reduce_s": ar, "broadcast_s": bc, "host": socket.gethostname(), "gpu": name, "finite": ok}


def figure(gpu_name: str | None, nodes: int) -> tuple[str | None, float | None]:
    """(what, GB/s) the planner assumes for one GPU's link: InfiniBand across nodes, NVLink within one."""
    from m2po_megatron.plan.hardware import GPUS

    if not gpu_name:
        return None, None
    for key, g in GPUS.items():
        if key in gpu_name.lower():
            return (("InfiniBand per GPU", g.ib_gb_s_per_gpu) if nodes > 1 else ("NVLink", g.nvlink_gb_s))
    return None, None


def run(cfg, ctx: dict) -> dict:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from m2po_megatron.infra.device import dist_backend

    ray = connect_ray(ctx)
    gpu = ctx["gpu"] or cluster_has_gpus(ray)
    backend = "nccl" if gpu else dist_backend()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if gpu:
        nodes = [n for n in nodes if n["Resources"].get("GPU", 0) >= 1]
        places = [(n["NodeID"], 1) for n in nodes for _ in range(int(n["Resources"]["GPU"]))]
        nbytes = GPU_BYTES
    else:
        places, nbytes = [(nodes[0]["NodeID"], 0)] * 2, CPU_BYTES
    if len(places) < 2:
        raise CheckSkipped(f"{len(places)} GPU in the Ray cluster: a collective needs two ranks")
    remote = ray.remote(CommRank)
    opts = [dict(num_cpus=0, num_gpus=g, scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False))
            for nid, g in places]
    budget = ctx["limit_s"] * 0.8
    ranks = [remote.options(**opts[0]).remote()]
    try:
        addr, port = ray.get(ranks[0].rendezvous_address.remote(), timeout=budget / 4)
        ranks += [remote.options(**o).remote() for o in opts[1:]]
        n = len(ranks)
        ray.get([a.set_dist_env.remote(i, n, addr, port) for i, a in enumerate(ranks)], timeout=budget / 4)
        try:
            got = ray.get([a.measure.remote(backend, nbytes, ITERS, budget / 2) for a in ranks], timeout=budget / 2)
        except ray.exceptions.GetTimeoutError:
            raise CheckFailed(f"{backend} collectives over {n} ranks did not finish within {budget / 2:.0f} s",
                              _network_fix(backend)) from None
        except ray.exceptions.RayTaskError as e:
            raise CheckFailed(f"{backend} group of {n} ranks failed: {str(e.cause if e.cause else e)[:400]}",
                              _network_fix(backend)) from None
    finally:
        for a in ranks:
            ray.kill(a)
    hosts = len({g["host"] for g in got})
    ar, bc = max(g["all_reduce_s"] for g in got), max(g["broadcast_s"] for g in got)
    numbers = {"backend": backend, "ranks": n, "nodes": hosts, "bytes": nbytes,
               "all_reduce_busbw_gb_s": round(nbytes * 2 * (n - 1) / n / ar / 1e9, 3),
               "broadcast_gb_s": round(nbytes / bc / 1e9, 3)}
    if not all(g["finite"] for g in got):
        raise CheckFailed("the all-reduce returned non-finite values", "a faulty GPU or driver: run nccl-tests "
                          "on the nodes and report the node", numbers)
    what, gb_s = figure(got[0]["gpu"], hosts)
    if gb_s is None:
        numbers["reference"] = "none (no planner figure for this device)"
        return numbers
    numbers.update(reference=what, reference_gb_s=gb_s,
                   all_reduce_of_reference=round(numbers["all_reduce_busbw_gb_s"] / gb_s, 3))
    if numbers["all_reduce_of_reference"] < MIN_OF_FIGURE:
        raise CheckFailed(f"all-reduce bus bandwidth {numbers['all_reduce_busbw_gb_s']:.1f} GB/s is under "
                          f"{MIN_OF_FIGURE:.0%} of {what} ({gb_s:g} GB/s, plan/hardware.py): NCCL is likely not on "
                          "the fast network (a socket fallback, or the wrong interface)", _network_fix(backend),
                          numbers)
    return numbers


def _network_fix(backend: str) -> str:
    if backend == "nccl":
        return ("set NCCL_SOCKET_IFNAME (and NCCL_IB_HCA) to the fast network's interface, rerun with "
                "NCCL_DEBUG=INFO and read which transport NCCL picked (docs/cluster.md, environment)")
    return "set GLOO_SOCKET_IFNAME to an interface every node reaches; check that no firewall blocks the ports"
