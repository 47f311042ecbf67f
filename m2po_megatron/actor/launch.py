"""Run a function in N processes with torchrun-style env (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), for tests and benchmarks. The Ray training loop sets the same variables on its actors.

Children are started with the spawn method (the caller's entry script needs an
`if __name__ == "__main__":` guard). On the first failure, or when the timeout passes, every child is
killed and the error (with the child's traceback) is raised in the parent. Return values travel back
pickled, so they may hold CPU tensors.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from typing import Any, Callable, Optional

from m2po_megatron.infra.net import rendezvous_env, serve_rendezvous


def _child(fn, rank, world_size, env, args, kwargs, q):
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    try:
        import torch

        torch.set_num_threads(int(os.environ.get("M2PO_THREADS_PER_RANK", "1")))
        out = fn(*args, **kwargs)
        q.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report everything, including SystemExit from inside fn
        q.put((rank, False, traceback.format_exc()))


class ChildFailed(RuntimeError):
    pass


def run_multiprocess(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: Optional[dict] = None,
    timeout: float = 120.0,
    env: Optional[dict] = None,
) -> list[Any]:
    """Run fn(*args, **kwargs) on ranks 0..world_size-1; return the results ordered by rank."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = serve_rendezvous("127.0.0.1")  # held by this process until the children are done
    base_env = {**rendezvous_env("127.0.0.1", store), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    base_env.update(env or {})
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, base_env, args, kwargs or {}, q), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildFailed(f"timed out after {timeout:.0f} s; ranks done: {sorted(results)}")
            try:
                rank, ok, payload = q.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise ChildFailed(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without a result")
                continue
            if not ok:
                raise ChildFailed(f"rank {rank} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        q.close()
    return [results[r] for r in range(world_size)]
