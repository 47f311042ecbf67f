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
import os
import pathlib
import shlex
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

from m2po_megatron.rollout import _http
from m2po_megatron.net import free_port


class ServerStartError(RuntimeError):
    """A server could not be started; the message carries the cause and the tail of its log."""


@dataclasses.dataclass
class ServerSpec:
    """One server; field names are SGLang's server_args (CLI: --model-path, --tp-size, ...)."""
    model_path: str
    engine: str = "local"                  # "local" (CPU server) | "sglang"
    host: str = "127.0.0.1"                # "auto": the Ray node's address (actor mode)
    port: int = 0                          # 0: a free port chosen at start
    tp_size: int = 1
    dp_size: int = 1
    mem_fraction_static: float | None = None
    context_length: int | None = None
    dtype: str = "auto"
    quantization: str | None = None        # e.g. "fp8" (sglang only)
    api_key: str | None = None
    skip_tokenizer_init: bool = True
    random_seed: int | None = None
    max_running_requests: int | None = None
    weight_version: str | None = None
    enable_deterministic_inference: bool = False  # sampling_seed takes effect only with it (SGLang and ours)
    extra_args: tuple[str, ...] = ()       # further SGLang flags, checked against the contract


# Flags our CPU server understands (a subset of SGLang's); anything else is refused for engine="local".
LOCAL_FLAGS = {"model_path", "host", "port", "api_key", "skip_tokenizer_init", "dtype", "context_length",
               "max_running_requests", "random_seed", "weight_version", "log_level", "tp_size", "dp_size",
               "mem_fraction_static", "quantization", "trust_remote_code", "served_model_name",
               "enable_deterministic_inference", "allow_auto_truncate"}
_FIELD_FLAGS = ["tp_size", "dp_size", "mem_fraction_static", "context_length", "dtype", "quantization",
                "random_seed", "max_running_requests", "weight_version"]


def build_command(spec: ServerSpec, python: str = sys.executable) -> list[str]:
    """argv for the server. Every flag is one of SGLang's (the contract generated from sglang's own parser);
    extra_args are checked as that parser would check them, and deprecated flags are refused."""
    from m2po_megatron.rollout.protocol import check_launch_args, launch_flag, launch_flags

    if spec.engine == "sglang":
        cmd = [python, "-m", "sglang.launch_server"]
    elif spec.engine == "local":
        cmd = [python, "-m", "m2po_megatron.rollout.local_server"]
    else:
        raise ValueError(f"engine {spec.engine!r} must be 'local' or 'sglang'")
    cmd += [launch_flag("model_path"), str(spec.model_path), launch_flag("host"), spec.host,
            launch_flag("port"), str(spec.port)]
    for name in _FIELD_FLAGS:
        v = getattr(spec, name)
        default = {"tp_size": 1, "dp_size": 1, "dtype": "auto"}.get(name)
        if v is not None and v != default:
            cmd += [launch_flag(name), str(v)]
    for name in ("skip_tokenizer_init", "enable_deterministic_inference"):
        if getattr(spec, name):
            cmd.append(launch_flag(name))
    if spec.api_key:
        cmd += [launch_flag("api_key"), spec.api_key]
    check_launch_args(list(spec.extra_args))
    if spec.engine == "local":
        flags = launch_flags()
        local = [a for a in spec.extra_args if a.startswith("--")
                 and flags[a.split("=", 1)[0]]["dest"] not in LOCAL_FLAGS]
        if local:
            raise ValueError(f"extra_args flag(s) {local} are not supported by the CPU server (engine='local')")
    cmd += list(spec.extra_args)
    return cmd


def redact(cmd: Sequence[str]) -> str:
    """The command for logs, with the API key hidden."""
    out = list(cmd)
    for i, a in enumerate(out[:-1]):
        if a == "--api-key":
            out[i + 1] = "***"
    return shlex.join(out)


def preflight(spec: ServerSpec) -> None:
    """Fail before anything starts: bad engine/flags, missing model directory, port in use."""
    if spec.engine not in ("local", "sglang"):
        raise ValueError(f"engine {spec.engine!r} must be 'local' or 'sglang'")
    mp = pathlib.Path(spec.model_path)
    looks_like_hub_id = not mp.is_absolute() and spec.model_path.count("/") == 1 and not mp.exists()
    if spec.engine == "local" or not looks_like_hub_id:
        if not (mp / "config.json").is_file():
            raise ServerStartError(f"model_path {spec.model_path!r}: no config.json there; point it at a HF model "
                                   "directory (or a hub id for engine='sglang')")
    if spec.engine == "local":
        if spec.tp_size != 1 or spec.dp_size != 1:
            raise ValueError(f"tp_size/dp_size must be 1 for engine='local' (got {spec.tp_size}/{spec.dp_size})")
        if spec.quantization:
            raise ValueError(f"quantization={spec.quantization!r} needs engine='sglang' on a GPU")
        if spec.dtype not in ("auto", "float", "float32"):
            raise ValueError(f"dtype={spec.dtype!r}: the CPU server runs float32 (use 'auto')")
    if spec.port:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no conflict
            try:
                s.bind((spec.host, spec.port))
            except OSError as e:
                raise ServerStartError(f"port {spec.port} on {spec.host} is not free ({e.strerror}); pick another "
                                       "port or 0 for a free one") from e
    build_command(spec)  # flag checks


def log_tail(path: str | os.PathLike, lines: int = 40) -> str:
    try:
        text = pathlib.Path(path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def wait_healthy(url: str, *, api_key: str | None = None, timeout_s: float = 600.0, proc=None,
                 log_path: str | None = None) -> None:
    """Poll /health_generate until 200; raise ServerStartError with the log tail if the process exits or time
    runs out."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerStartError(f"server {url} exited with code {proc.returncode} before becoming healthy; "
                                   f"log {log_path}:\n{log_tail(log_path) if log_path else ''}")
        try:
            status, text = _http.request(f"{url}/health_generate", api_key=api_key, timeout=30)
            if status == 200:
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
                 env: dict | None = None):
        self.spec = dataclasses.replace(spec, port=spec.port or free_port(spec.host))
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
        cmd = build_command(self.spec)
        pathlib.Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, **(self.env or {}))
        with open(self.log_path, "a") as log:
            log.write(f"\n==== start {time.strftime('%Y-%m-%d %H:%M:%S')} (restart {self.restarts}): "
                      f"{redact(cmd)}\n")
            log.flush()
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def start(self) -> str:
        preflight(self.spec)
        self._spawn()
        try:
            wait_healthy(self.url, api_key=self.spec.api_key, timeout_s=self.health_timeout_s, proc=self.proc,
                         log_path=self.log_path)
        except ServerStartError:
            self._kill()
            raise
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
                        return
                    self.restarts += 1
                    time.sleep(0.5)  # let the port go
                    try:
                        self._spawn()
                        wait_healthy(self.url, api_key=self.spec.api_key, timeout_s=self.health_timeout_s,
                                     proc=self.proc, log_path=self.log_path)
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


class ServerActor:
    """Ray actor body: owns one ServerProcess on the node it was placed on (use EngineManager to create it)."""

    def __init__(self, spec: ServerSpec, log_path: str, max_restarts: int, health_timeout_s: float,
                 env: dict | None = None):
        if spec.host == "auto":
            import ray

            spec = dataclasses.replace(spec, host=ray.util.get_node_ip_address())
        self.server = ServerProcess(spec, log_path, max_restarts=max_restarts, health_timeout_s=health_timeout_s,
                                    env=env)

    def start(self) -> str:
        return self.server.start()

    def info(self) -> dict:
        return self.server.info()

    def kill_server(self) -> None:
        self.server.kill()

    def stop(self) -> None:
        self.server.stop()


class EngineManager:
    """Starts N servers (local or sglang), as Ray actors or plain subprocesses, and returns their URLs."""

    def __init__(self, specs: Sequence[ServerSpec], *, run_dir: str, use_ray: bool = True, max_restarts: int = 3,
                 health_timeout_s: float = 600.0, node_ids: Sequence[str] | None = None,
                 num_cpus_per_server: float = 1, num_gpus_per_server: float | None = None, env: dict | None = None):
        """node_ids: Ray node ids to pin server i to (hard affinity); otherwise Ray places them (use a custom
        resource or placement group in the cluster config to reserve rollout nodes). num_gpus_per_server
        defaults to tp_size x dp_size for sglang (the GPUs one server uses) and 0 for local."""
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
        self.servers: list = []   # ServerProcess or Ray actor handles
        self.urls: list[str] = []

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

    def _start_ray(self) -> None:
        import ray

        for i, spec in enumerate(self.specs):
            opts = {"num_cpus": self.num_cpus,
                    "num_gpus": self.num_gpus if self.num_gpus is not None else (
                        spec.tp_size * spec.dp_size if spec.engine == "sglang" else 0),
                    "max_concurrency": 4}
            if self.node_ids is not None:
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self.node_ids[i], soft=False)
            actor = ray.remote(**opts)(ServerActor).remote(spec, self.log_path(i), self.max_restarts,
                                                           self.health_timeout_s, self.env)
            self.servers.append(actor)
        refs = [a.start.remote() for a in self.servers]
        try:
            self.urls = ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            raise ServerStartError(str(e.cause) if getattr(e, "cause", None) else str(e)) from e

    def info(self) -> list[dict]:
        if self.use_ray:
            import ray

            return ray.get([a.info.remote() for a in self.servers])
        return [s.info() for s in self.servers]

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
