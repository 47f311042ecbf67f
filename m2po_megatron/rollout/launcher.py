"""Start, watch and restart rollout servers: SGLang on GPU nodes (engine="sglang") or our CPU server
(engine="local"), with the same flags, so the training loop has one code path.

    manager = EngineManager([ServerSpec(model_path=..., engine="local")] * 2, run_dir="runs/x", use_ray=True)
    urls = manager.start()        # blocks until every server answers /health_generate
    ...
    manager.shutdown()

or attach to servers started elsewhere: EngineManager.attach(urls, api_key=...) -> urls (checked healthy).

With use_ray=True each server is a Ray actor (ServerActor) pinned to a rollout node; the actor runs the
server as a subprocess, keeps its log in run_dir/rollout/, and restarts it (same port) at most max_restarts
times when it exits. Load balancing is the client's (least outstanding requests per server): weight sync,
pause and abort must address every server anyway, so no sglang-router sits in front."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import concurrent.futures
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

from m2po_megatron.rollout import _http
from m2po_megatron.infra.net import free_port
from m2po_megatron.rollout.server_spec import (  # noqa: F401 - re-exported: the launcher's public names
    ServerSpec, ServerStartError, build_command, preflight, redact)


class ForeignServerError(ServerStartError):
    """Something answers at the server's URL, but it is not the server this run started (another run's
    server on a port taken in between): the run never talks to it."""


LISTEN_FD_ENV = "M2PO_LISTEN_FD"  # the CPU server serves on this inherited, already bound socket


def bind_listener(host: str, port: int = 0, wait_s: float = 0.0) -> socket.socket:
    """A socket bound to host:port (0: the kernel picks a free port), handed to the CPU server, which
    serves on it: the port is never free between choosing and serving, and stays ours across restarts.
    `wait_s`: retry while the port is still held (a killed predecessor being reaped)."""
    deadline = time.monotonic() + wait_s
    while True:
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
            s.set_inheritable(True)
            return s
        except OSError as e:
            s.close()
            if time.monotonic() >= deadline:
                raise ServerStartError(f"port {port} on {host} is not free ({e.strerror}); pick another port or 0 "
                                       "for a free one (rollout.port=0)") from e
            time.sleep(0.2)


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL the server when the thread that started it goes (its Ray actor killed), so no
    orphan keeps the port. Linux only; called between fork and exec."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


try:  # resolved now: the child between fork and exec must not load libraries
    import ctypes

    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):  # pragma: no cover - no prctl
    _PRCTL = None


def log_tail(path: str | os.PathLike, lines: int = 40) -> str:
    try:
        text = pathlib.Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def check_identity(url: str, served_model_name: str, api_key: str | None = None) -> None:
    """Raise ForeignServerError unless the server at `url` reports `served_model_name` (SGLang's
    /get_server_info returns its server args; so does the CPU server)."""
    try:
        status, text = _http.request(f"{url}/get_server_info", api_key=api_key, timeout=30)
        got = json.loads(text).get("served_model_name") if status == 200 else f"HTTP {status}"
    except (OSError, ValueError, AttributeError) as e:
        got = f"no answer ({e!r})"
    if got != served_model_name:
        raise ForeignServerError(f"{url} answers, but not as this run's server (served_model_name {got!r}, expected "
                                 f"{served_model_name!r}): another process holds the port; the run will not use it")


def physical_routing_servers(urls: Sequence[str], api_key: str | None = None) -> str | None:
    """For R3 with servers started elsewhere: the refusal naming each server whose /get_server_info shows
    expert-location dispatch (its recorded expert ids are physical, rollout/routing.py), or None."""
    from m2po_megatron.rollout.routing import expert_location_settings, physical_routing_refusal

    bad = []
    for url in urls:
        status, text = _http.request(f"{url}/get_server_info", api_key=api_key, timeout=30)
        settings = expert_location_settings(json.loads(text)) if status == 200 else []
        if settings:
            bad.append(f"{url}: {', '.join(settings)}")
    return physical_routing_refusal("rollout.urls", bad) if bad else None


def wait_healthy(url: str, *, api_key: str | None = None, timeout_s: float = 600.0, proc=None,
                 log_path: str | None = None, served_model_name: str | None = None) -> None:
    """Poll /health_generate until 200 (then, given `served_model_name`, check that the server is ours);
    raise ServerStartError with the log tail if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerStartError(f"server {url} exited with code {proc.returncode} before becoming healthy; "
                                   f"log {log_path}:\n{log_tail(log_path) if log_path else ''}")
        try:
            status, text = _http.request(f"{url}/health_generate", api_key=api_key, timeout=30)
            if status == 200:
                if served_model_name is not None:
                    check_identity(url, served_model_name, api_key)
                return
            last = f"HTTP {status}: {text[:200]}"
        except OSError as e:
            last = repr(e)
        time.sleep(0.5)
    raise ServerStartError(f"server {url} not healthy after {timeout_s:.0f} s ({last}); log {log_path}:\n"
                           f"{log_tail(log_path) if log_path else ''}")


class ServerProcess:
    """One server subprocess with its log file, health wait and bounded automatic restarts."""

    def __init__(self, spec: ServerSpec, log_path: str, *, max_restarts: int = 3, health_timeout_s: float = 600.0,
                 env: dict | None = None, bind_wait_s: float = 0.0):
        """bind_wait_s: how long to wait for a fixed port still held by a killed predecessor."""
        # The CPU server serves on a socket bound here (no race, same port across restarts); SGLang binds
        # its own, so its free port is chosen here and a start that loses the port is retried elsewhere.
        self._listener = bind_listener(spec.host, spec.port, bind_wait_s) if spec.engine == "local" else None
        port = self._listener.getsockname()[1] if self._listener else (spec.port or free_port(spec.host))
        self._auto_port = not spec.port
        self.spec = dataclasses.replace(spec, port=port)
        # Every spawn from one long-lived thread: PR_SET_PDEATHSIG fires when the spawning thread ends.
        self._spawner = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawn")
        self.log_path = str(log_path)
        self.max_restarts = max_restarts
        self.health_timeout_s = health_timeout_s
        self.env = env
        self.restarts = 0
        self.proc: subprocess.Popen | None = None
        self.last_error: str | None = None
        self._stopping = False
        self._lock = threading.Lock()
        self._watch: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.spec.host}]" if ":" in self.spec.host else self.spec.host
        return f"http://{host}:{self.spec.port}"

    def _spawn(self) -> None:
        self._spawner.submit(self._spawn_here).result()

    def _spawn_here(self) -> None:
        cmd = build_command(self.spec)
        pathlib.Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, **(self.env or {}))
        fds: tuple[int, ...] = ()
        if self._listener is not None:
            env[LISTEN_FD_ENV] = str(self._listener.fileno())
            fds = (self._listener.fileno(),)
        with open(self.log_path, "a") as log:
            log.write(f"\n==== start {time.strftime('%Y-%m-%d %H:%M:%S')} (restart {self.restarts}): "
                      f"{redact(cmd)}\n")
            log.flush()
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=fds,
                                         start_new_session=True, preexec_fn=_die_with_parent)

    def _wait_healthy(self) -> None:
        wait_healthy(self.url, api_key=self.spec.api_key, timeout_s=self.health_timeout_s, proc=self.proc,
                     log_path=self.log_path, served_model_name=self.spec.served_model_name)

    def start(self) -> str:
        if self._listener is None:
            preflight(self.spec)
        for attempt in range(3):
            self._spawn()
            try:
                self._wait_healthy()
                break
            except ServerStartError as e:
                self._kill()
                # SGLang on a port chosen here that someone took first: choose another (bounded)
                if not (self._auto_port and self._listener is None and attempt < 2
                        and (isinstance(e, ForeignServerError) or "address already in use" in str(e).lower())):
                    raise
                self.spec = dataclasses.replace(self.spec, port=free_port(self.spec.host))
        self._watch = threading.Thread(target=self._watchdog, daemon=True, name=f"watch-{self.spec.port}")
        self._watch.start()
        return self.url

    def _watchdog(self) -> None:
        while not self._stopping:
            proc = self.proc
            if proc is not None and proc.poll() is not None and not self._stopping:
                with self._lock:
                    if self._stopping:
                        return
                    if self.restarts >= self.max_restarts:
                        self.last_error = f"exited with {proc.returncode}; restart budget {self.max_restarts} spent"
                        if self._listener is not None:  # refuse connections now rather than queue them
                            self._listener.close()
                        return
                    self.restarts += 1
                    time.sleep(0.5)  # let the port go
                    try:
                        self._spawn()
                        self._wait_healthy()
                        self.last_error = None
                    except ServerStartError as e:
                        self.last_error = str(e)
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def info(self) -> dict:
        return {"url": self.url, "alive": self.alive(), "restarts": self.restarts, "log": self.log_path,
                "pid": self.proc.pid if self.proc else None, "last_error": self.last_error}

    def kill(self) -> None:
        """SIGKILL the server (fault injection); the watchdog restarts it within budget."""
        if self.proc is not None:
            self.proc.kill()

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)

    def stop(self) -> None:
        self._stopping = True
        with self._lock:
            self._kill()
        if self._listener is not None:
            self._listener.close()
        self._spawner.shutdown(wait=False)


class ServerActor:
    """Ray actor body: owns one ServerProcess on the node it was placed on (use EngineManager to create it)."""

    def __init__(self, spec: ServerSpec, log_path: str, max_restarts: int, health_timeout_s: float,
                 env: dict | None = None, bind_wait_s: float = 0.0):
        if spec.host == "auto":
            import ray

            spec = dataclasses.replace(spec, host=ray.util.get_node_ip_address())
        self.server = ServerProcess(spec, log_path, max_restarts=max_restarts, health_timeout_s=health_timeout_s,
                                    env=env, bind_wait_s=bind_wait_s)

    def start(self) -> str:
        return self.server.start()

    def info(self) -> dict:
        return {**self.server.info(), "actor_pid": os.getpid()}

    def kill_server(self) -> None:
        self.server.kill()

    def stop(self) -> None:
        self.server.stop()


class EngineManager:
    """Starts N servers (local or sglang), as Ray actors or plain subprocesses, and returns their URLs."""

    def __init__(self, specs: Sequence[ServerSpec], *, run_dir: str, use_ray: bool = True, max_restarts: int = 3,
                 health_timeout_s: float = 600.0, node_ids: Sequence[str] | None = None,
                 num_cpus_per_server: float = 1, num_gpus_per_server: float | None = None, env: dict | None = None,
                 bundles: Sequence | None = None, server_envs: Sequence[dict] | None = None,
                 resources: dict | None = None):
        """node_ids: Ray node ids to pin server i to (hard affinity); otherwise Ray places them (use a custom
        resource or placement group in the cluster config to reserve rollout nodes). num_gpus_per_server
        defaults to tp_size x dp_size for sglang (the GPUs one server uses) and 0 for local.
        Colocated (docs/colocate.md): `bundles` gives server i's (placement group, bundle index), a trainer rank's
        bundle it shares, `resources` what its actor takes there, and `server_envs` its own environment on top
        of `env` (the GPUs it runs on)."""
        if not specs:
            raise ValueError("EngineManager needs at least one ServerSpec")
        if node_ids is not None and len(node_ids) != len(specs):
            raise ValueError(f"node_ids has {len(node_ids)} entries for {len(specs)} servers")
        self.specs = list(specs)
        self.run_dir = pathlib.Path(run_dir)
        self.use_ray = use_ray
        self.max_restarts = max_restarts
        self.health_timeout_s = health_timeout_s
        self.node_ids = node_ids
        self.num_cpus = num_cpus_per_server
        self.num_gpus = num_gpus_per_server
        self.env = env
        self.bundles = list(bundles) if bundles is not None else None
        self.server_envs = list(server_envs) if server_envs is not None else None
        self.resources = resources
        self.servers: list = []   # ServerProcess or Ray actor handles
        self.urls: list[str] = []
        self._dead_restarts: list[int] = [0] * len(self.specs)  # restarts counted by actors that died
        self._last: list[dict] = [{} for _ in self.specs]  # the latest info of each server
        self._gone: list[dict | None] = [None] * len(self.specs)  # servers given up on, and why
        self._lock = threading.RLock()  # info() and respawns: the loop's calls and the actor watch
        self._closing = threading.Event()
        self._watch: threading.Thread | None = None

    def log_path(self, i: int) -> str:
        return str(self.run_dir / "rollout" / f"server_{i}.log")

    def start(self) -> list[str]:
        # All cheap checks first, for every server, before any process starts.
        for spec in self.specs:
            if self.use_ray and spec.host not in ("127.0.0.1", "localhost", "auto") and spec.port:
                continue  # a remote node's port cannot be checked from here; the actor checks it
            if spec.host != "auto":
                preflight(spec)
        try:
            if self.use_ray:
                self._start_ray()
            else:
                for i, spec in enumerate(self.specs):
                    sp = ServerProcess(spec, self.log_path(i), max_restarts=self.max_restarts,
                                       health_timeout_s=self.health_timeout_s, env=self.env)
                    self.servers.append(sp)
                    self.urls.append(sp.start())
        except BaseException:
            self.shutdown()
            raise
        return list(self.urls)

    def _new_actor(self, i: int, spec: ServerSpec, bind_wait_s: float = 0.0, max_restarts: int | None = None):
        import ray

        opts = {"num_cpus": self.num_cpus,
                "num_gpus": self.num_gpus if self.num_gpus is not None else (
                    spec.tp_size * spec.dp_size if spec.engine == "sglang" else 0),
                "max_concurrency": 4}
        if self.node_ids is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self.node_ids[i], soft=False)
        if self.bundles is not None:  # colocated: in a trainer rank's bundle (a restart goes back there)
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            pg, index = self.bundles[i]
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                           placement_group_bundle_index=index)
        if self.resources:
            opts["resources"] = dict(self.resources)
        env = {**(self.env or {}), **(self.server_envs[i] if self.server_envs else {})}
        budget = self.max_restarts if max_restarts is None else max_restarts
        return ray.remote(**opts)(ServerActor).remote(spec, self.log_path(i), budget, self.health_timeout_s,
                                                      env or None, bind_wait_s)

    def _get(self, refs, what: str):
        """ray.get with a deadline that names what it waited for; a task error becomes ServerStartError."""
        import ray

        timeout = self.health_timeout_s + 120  # the health wait inside, plus a Ray worker's start
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise ServerStartError(f"{what}: no answer within {timeout:.0f} s (is a Ray node with free "
                                   f"'rollout' resources up? logs under {self.run_dir / 'rollout'})") from None
        except ray.exceptions.RayTaskError as e:
            raise ServerStartError(str(e.cause) if getattr(e, "cause", None) else str(e)) from e

    def _start_ray(self) -> None:
        self.servers = [self._new_actor(i, spec) for i, spec in enumerate(self.specs)]
        self.urls = self._get([a.start.remote() for a in self.servers], "starting the rollout servers")
        self._watch = threading.Thread(target=self._watch_actors, name="rollout-actor-watch", daemon=True)
        self._watch.start()

    def _watch_actors(self, period_s: float = 1.0) -> None:
        """Replace a dead server actor within about a second (`info` does it), whatever the loop is doing:
        the loop may be blocked waiting for that very server's answers, so it cannot be the one to notice."""
        while not self._closing.wait(period_s):
            try:
                self.info()
            except Exception as e:  # noqa: BLE001 - the loop's own info() calls report it; keep watching
                print(f"[m2po] watching the rollout server actors: {type(e).__name__}: {e}", flush=True)

    def _respawn(self, i: int, cause: BaseException) -> dict:
        """Server i's Ray actor died (its server process went with it, PR_SET_PDEATHSIG): start a new actor
        serving the same URL, counted against the server's restart budget. Returns its info, or a down
        entry saying why (kept: a server given up on is not retried)."""
        import ray

        if self._closing.is_set():  # stopped by shutdown, not dead
            return {"url": self.urls[i], "alive": False, "restarts": self._dead_restarts[i],
                    "log": self.log_path(i), "pid": None, "actor_pid": None, "last_error": "shut down"}
        last = self._last[i]
        self._dead_restarts[i] = (last["restarts"] if last else self._dead_restarts[i]) + 1
        down = {"url": self.urls[i], "alive": False, "restarts": self._dead_restarts[i], "log": self.log_path(i),
                "pid": None, "actor_pid": None}
        try:
            ray.kill(self.servers[i])
        except Exception:  # noqa: BLE001 - already gone
            pass
        if self._dead_restarts[i] > self.max_restarts:
            self._gone[i] = {**down, "last_error": f"its Ray actor died ({type(cause).__name__}) and the restart "
                                                   f"budget rollout.max_restarts = {self.max_restarts} is spent"}
            return self._gone[i]
        print(f"[m2po] the Ray actor of rollout server {self.urls[i]} died ({type(cause).__name__}); starting a "
              f"new one on the same port", flush=True)
        host, port = self.urls[i].rsplit("//", 1)[1].rsplit(":", 1)
        spec = dataclasses.replace(self.specs[i], host=host.strip("[]"), port=int(port))
        self.servers[i] = self._new_actor(i, spec, bind_wait_s=30.0,
                                          max_restarts=self.max_restarts - self._dead_restarts[i])
        if self._closing.is_set():  # shutdown began meanwhile: leave nothing behind
            ray.kill(self.servers[i])
            return down
        try:
            self._get(self.servers[i].start.remote(), f"restarting rollout server {self.urls[i]} after its actor died")
            info = self._get(self.servers[i].info.remote(), f"rollout server {self.urls[i]}")
        except (ServerStartError, ray.exceptions.RayActorError) as e:
            self._gone[i] = {**down, "last_error": f"its Ray actor died and a new one could not start it: {e}"}
            return self._gone[i]
        return {**info, "restarts": self._dead_restarts[i] + info["restarts"]}

    def info(self) -> list[dict]:
        """Each server's url, liveness, restarts (process and actor restarts together), log and pids. A
        server whose Ray actor died is restarted here (within max_restarts), not reported as a crash."""
        if not self.use_ray:
            return [s.info() for s in self.servers]
        with self._lock:
            return self._ray_info()

    def _ray_info(self) -> list[dict]:
        import ray

        out = []
        for i, a in enumerate(self.servers):
            if self._gone[i] is not None:
                info = self._gone[i]
            else:
                try:
                    info = self._get(a.info.remote(), f"rollout server {self.urls[i]}")
                    info = {**info, "restarts": self._dead_restarts[i] + info["restarts"]}
                except ray.exceptions.RayActorError as e:
                    info = self._respawn(i, e)
            self._last[i] = info
            out.append(info)
        return out

    def kill_server(self, i: int) -> None:
        """Fault injection for tests and drills: SIGKILL server i (it is restarted within budget)."""
        if self.use_ray:
            import ray

            ray.get(self.servers[i].kill_server.remote())
        else:
            self.servers[i].kill()

    def shutdown(self) -> None:
        if self.use_ray:
            import ray

            self._closing.set()
            if self._watch is not None:
                self._watch.join(timeout=10)  # a respawn under way sees _closing and kills what it started
            for a in self.servers:
                try:
                    ray.get(a.stop.remote(), timeout=60)
                except Exception:  # noqa: BLE001 - best effort: the actor may already be gone
                    pass
                ray.kill(a)
        else:
            for s in self.servers:
                s.stop()
        self.servers, self.urls = [], []

    @staticmethod
    def attach(urls: Sequence[str], *, api_key: str | None = None, timeout_s: float = 60.0) -> list[str]:
        """Use servers started elsewhere; checks each answers /health_generate."""
        out = [u.rstrip("/") for u in urls]
        for u in out:
            wait_healthy(u, api_key=api_key, timeout_s=timeout_s)
        return out
