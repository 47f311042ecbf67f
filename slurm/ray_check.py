"""Small checks of a job's Ray cluster, run by m2po.sbatch (and useful by hand on a fresh allocation).

  python slurm/ray_check.py wait ADDRESS NODES TIMEOUT_S
      wait until NODES Ray nodes are alive; exit 1 with the missing count on timeout.
  python slurm/ray_check.py placement ADDRESS
      place one actor on every unit of the "trainer" and "rollout" custom resources (one per node) and
      print `[placement] role=<trainer|rollout> node=<hostname> ip=<ip>` per actor; exit 1 when a role
      has no node. A stand-in driver (M2PO_DRIVER_CMD) that proves the layout before a long run.
"""
from __future__ import annotations

import os
import socket
import sys
import time


def _init(address: str):
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    return ray


def _listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


def wait(address: str, nodes: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:  # the head may be restarting (ray_node.sh retries a failed start)
        # ray.init blocks for good when the head's GCS is not there: call it only once the port answers
        if not _listening(address):
            if time.monotonic() > deadline:
                print(f"[ray_check] nothing listens at {address} after {timeout_s:.0f} s; see the ray-head log "
                      f"in the run's logs/ directory", file=sys.stderr, flush=True)
                return 1
            time.sleep(2)
            continue
        try:
            ray = _init(address)
            break
        except (ConnectionError, RuntimeError) as e:
            if time.monotonic() > deadline:
                print(f"[ray_check] cannot connect to {address}: {e}", file=sys.stderr, flush=True)
                return 1
            time.sleep(2)
    alive = 0
    while time.monotonic() < deadline:
        alive = sum(1 for n in ray.nodes() if n["Alive"])
        if alive >= nodes:
            print(f"[ray_check] {alive}/{nodes} Ray nodes alive", flush=True)
            return 0
        time.sleep(1)
    print(f"[ray_check] only {alive}/{nodes} Ray nodes joined after {timeout_s:.0f} s; see the ray-*.log "
          f"files in the run's logs/ directory", file=sys.stderr, flush=True)
    return 1


def placement(address: str) -> int:
    ray = _init(address)

    @ray.remote(num_cpus=0)
    class Probe:
        def where(self) -> tuple[str, str]:
            return socket.gethostname(), ray.util.get_node_ip_address()

    status = 0
    for role in ("trainer", "rollout"):
        nodes = [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(role, 0) > 0]
        if not nodes:
            print(f"[placement] role={role} node=NONE: no Ray node offers the '{role}' resource",
                  file=sys.stderr, flush=True)
            status = 1
            continue
        for n in nodes:  # one actor per node holding the role, pinned there by its m2po_node_<rank> tag
            tag = next(k for k in n["Resources"] if k.startswith("m2po_node_"))
            actor = Probe.options(resources={role: 1, tag: 0.001}).remote()
            host, ip = ray.get(actor.where.remote(), timeout=120)
            print(f"[placement] role={role} node={host} ip={ip}", flush=True)
            ray.kill(actor)
    return status


def main(argv: list[str]) -> int:
    if len(argv) >= 4 and argv[0] == "wait":
        return wait(argv[1], int(argv[2]), float(argv[3]))
    if len(argv) >= 2 and argv[0] == "placement":
        return placement(argv[1])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    sys.exit(main(sys.argv[1:]))
