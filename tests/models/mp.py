"""Launching N local ranks (torchrun-style env, gloo) for multi-process tests; kills them all on failure."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from m2po_megatron.infra.net import rendezvous_env, serve_rendezvous


def run_ranks(script: str, args: list[str], world_size: int, timeout: float = 240.0, env_extra=None) -> list[str]:
    """Run `python script *args` as ranks 0..world_size-1; returns their combined outputs; raises on failure."""
    store = serve_rendezvous()  # bound now; the ranks join it as clients
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   OMP_NUM_THREADS="1", **rendezvous_env("127.0.0.1", store), **(env_extra or {}))
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            left = max(1.0, deadline - time.monotonic())
            out, _ = p.communicate(timeout=left)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if bad:
        tail = "\n".join(f"--- rank {i} ---\n{outs[i][-3000:] if i < len(outs) else ''}" for i, _ in bad)
        raise RuntimeError(f"ranks failed {bad}:\n{tail}")
    return outs
