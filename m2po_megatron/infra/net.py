"""Small network helpers shared by the launcher, the trainer group and the weight sync."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on `host` now (bind to port 0 and read it back), for a server that binds it a little
    later. torch.distributed groups never use this: they rendezvous at a store bound at once (below)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve_rendezvous(host: str = "127.0.0.1"):
    """Host torch.distributed's rendezvous store on an OS-chosen port of `host`, bound at once and kept.

    Picking a free port and letting rank 0 bind it later races with every other process on the node (a
    loaded CI machine lost that race: EADDRINUSE). Ranks given `rendezvous_env(store)` (as torchelastic's
    agent does) all join this store as clients, so nothing binds after the port is known. Keep the returned
    store alive until the group is up."""
    from torch.distributed import TCPStore

    return TCPStore(host_name=host, port=0, is_master=True, wait_for_workers=False)


def rendezvous_env(host: str, store) -> dict:
    """MASTER_ADDR/MASTER_PORT of a store from serve_rendezvous, with torch's switch that makes env://
    ranks (rank 0 included) clients of it."""
    return {"MASTER_ADDR": host, "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
