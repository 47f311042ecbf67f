"""Batch-level M2PO mask and loss over gloo process groups equal the single-process concatenated batch."""

import os
import pathlib
import subprocess
import sys

import pytest

from m2po_megatron.infra.net import rendezvous_env, serve_rendezvous

WORKER = pathlib.Path(__file__).with_name("_algo_dist_worker.py")


def run_ranks(world: int, replicas: int, timeout: float = 240.0):
    store = serve_rendezvous()  # bound now; every rank (0 included) joins it as a client
    env = dict(os.environ, OMP_NUM_THREADS="1", **rendezvous_env("127.0.0.1", store))
    port = store.port
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "--rank", str(r), "--world", str(world), "--port", str(port),
             "--replicas", str(replicas)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        for r in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:  # never leave a rank behind, whatever happened
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r} failed:\n{out[-4000:]}"
        assert f"rank {r} ok" in out


@pytest.mark.timeout(280)
def test_two_dp_ranks_equal_concatenated_batch():
    run_ranks(world=2, replicas=1)


@pytest.mark.timeout(280)
def test_two_dp_ranks_times_two_replicas_do_not_double_count():
    # 4 ranks = 2 DP x 2 tensor-parallel-style replicas holding identical data.
    run_ranks(world=4, replicas=2)
