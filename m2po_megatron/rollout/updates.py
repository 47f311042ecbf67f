"""Weight updates of the rollout servers, driver side: the weight-sync group with every server, pushing the
trainer's weights (generation paused meanwhile), and recovery when a server restarts. The trainer side of the
transfer is rollout/weight_sync.py, run by global rank 0.

A restarted server lost the weight-sync group and holds the base weights; `WeightUpdater` notices it from the
launcher's restart counts, waits for every server to be healthy, forms a new group with all of them and
pushes the current weights. It keeps what that needs (the servers, their restart counts, the version they
hold), so the loop only says which version to push.

Colocated (cluster.colocate, docs/colocate.md) there is no group: each engine's first trainer rank updates it
from tensors on the same GPU (rollout/tensor_sync.py); `connect` tells the ranks which engine is theirs, and
a push is the same call on the ranks. run/colocation.py brackets each push with the memory swap."""
from __future__ import annotations

import time

from omegaconf import DictConfig

from m2po_megatron.infra import trace


class WeightUpdater:
    """`trainers` answer call(method, ...); `engines` is the EngineManager (None when attached to
    rollout.urls: nothing restarts them); `urls` the servers and `api_key` their key. `synced`: the version the
    servers hold."""

    def __init__(self, cfg: DictConfig, trainers, engines, urls: list[str], api_key: str | None = None):
        self.cfg, self.trainers, self.engines, self.urls, self.api_key = cfg, trainers, engines, urls, api_key
        self.generator = None  # paused during a push; set by `attach`
        self.synced = 0  # new servers hold the base weights
        self.seen: list[int] = []  # restart counts at the last (re)sync

    def connect(self, generation: int = 0) -> None:
        """Form the weight-sync group of the trainer's rank 0 with every server rank (colocated: name each
        engine's sender)."""
        r = self.cfg.rollout
        if self.cfg.cluster.colocate:
            self.trainers.call("init_tensor_sync", self.urls, self.api_key, r.bucket_mb, r.tp_size * r.dp_size,
                               r.tp_size if r.engine == "sglang" else 1, r.request_timeout_s,
                               timeout=r.health_timeout_s, what="naming each colocated engine's sender")
            return
        ranks = r.tp_size * r.dp_size if r.engine == "sglang" else 1  # a server's GPU ranks all join the group
        self.trainers.call("init_weight_sync", self.urls, self.api_key, r.bucket_mb, 0,
                           r.pause_mode, ranks, f"weight_update_group_{generation}", timeout=r.health_timeout_s,
                           what=f"forming the weight-sync group with the rollout servers {self.urls} "
                                f"(rollout.health_timeout_s)")

    def attach(self, generator) -> None:
        """The generator to pause during pushes and to tell of each sync."""
        self.generator = generator

    def watch_restarts(self) -> None:
        """From now on a server restart is noticed (`resync_restarted`) and answered with a re-sync."""
        self.seen = self.restarts()

    def push(self, version: int) -> dict:
        """Pause admission, push the trainer's weights to every server (the weight sync itself retracts and
        continues in-flight requests, or updates in flight), tell the generator."""
        t0 = time.perf_counter()
        self.generator.pause()
        t1 = time.perf_counter()
        trace.complete("pause", "sync", t0, t1, tid="loop")
        try:
            with trace.span("push", "sync", tid="loop", version=version):
                stats = self.trainers.call("sync_weights", version, what=f"the weight sync of version {version}")[0]
            self.generator.on_sync(version)
        finally:
            t2 = time.perf_counter()
            self.generator.resume()
            trace.complete("resume", "sync", t2, time.perf_counter(), tid="loop")
        self.synced = version
        return {f"weight_sync/{k}": v for k, v in stats.items() if isinstance(v, (int, float))}

    def restarts(self) -> list[int]:
        return [] if self.engines is None else [i["restarts"] for i in self.engines.info()]

    def resync_restarted(self, version: int) -> dict:
        """Re-sync if a server restarted since the last look. Its requests in flight were re-issued by the
        client; groups it answered with old weights are dropped (counted) by the generator."""
        now = self.restarts()
        if now == self.seen:
            return {}
        self.wait_servers()
        self.connect(generation=sum(now))
        stats = self.push(version)
        self.seen = self.restarts()
        print(f"[m2po] rollout server restart detected (restarts {self.seen}); weights re-synced at version "
              f"{version}", flush=True)
        return {"rollout/server_restarts": sum(self.seen), **stats}

    def sync_or_recover(self, version: int) -> dict:
        """Push weights; if a server died during the push, wait for its restart and re-sync everyone."""
        import ray

        try:
            return self.push(version)
        except ray.exceptions.RayTaskError:
            if self.engines is None:
                raise
            deadline = time.monotonic() + self.cfg.rollout.health_timeout_s
            while self.restarts() == self.seen and time.monotonic() < deadline:
                time.sleep(1.0)  # the watchdog notices the death within a second
            if self.restarts() == self.seen:
                raise
            return self.resync_restarted(version)

    def wait_servers(self) -> None:
        """Block until every server answers /health_generate; a server whose restart budget is spent ends
        the run with its URL and log."""
        from m2po_megatron.rollout.launcher import wait_healthy
        from m2po_megatron.infra.errors import RunError

        r = self.cfg.rollout
        for info in self.engines.info():
            if info.get("last_error") and not info.get("alive"):
                raise RunError(f"rollout server {info['url']} is down and was not restarted: "
                               f"{info['last_error']} (rollout.max_restarts = {r.max_restarts}); "
                               f"log: {info['log']}")
        for url in self.urls:
            wait_healthy(url, api_key=self.api_key, timeout_s=r.health_timeout_s)
