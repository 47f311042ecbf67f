"""The calculator task with its environment in a process of its own, behind HTTP: the boundary a real
environment (a sandbox, a simulator, a web service) has. Recipes name it `rollout.function: calculator_http`.

The rollout function starts the environment server once per process (`python -m
m2po_megatron.examples.http_env`), on 127.0.0.1 and a free port, with a fresh API key it passes in the
environment (never on the command line or in a log); or it uses a server already running, given by
`rollout.function_args: {env_url: ..., env_api_key_env: NAME_OF_THE_VARIABLE_HOLDING_THE_KEY}`. The server
exits with the process that started it (it watches its parent), so a killed run leaves none behind.

    POST /step  {"calls": [{"name": "calc", "arguments": {...}, "error": ""}, ...]}
        -> {"replies": [{"text": "<result>1776</result>", "ok": true}, ...]}
    GET /health -> 200

Written only with `m2po_megatron.api` (and aiohttp, which the package depends on), as a user's would be."""
from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from m2po_megatron.api import RolloutContext, RolloutResult, ToolCall
from m2po_megatron.examples import calculator

KEY_ENV = "M2PO_EXAMPLE_ENV_API_KEY"
START_TIMEOUT_S = 60.0


# -- the environment's side: its own process --------------------------------------------------------------
def make_app(api_key: str):
    from aiohttp import web

    async def step(request):
        if request.headers.get("Authorization") != f"Bearer {api_key}":
            return web.json_response({"error": "unauthorized"}, status=401)
        try:
            body = await request.json()
            calls = [ToolCall(str(c.get("name", "")), dict(c.get("arguments") or {}), error=str(c.get("error", "")))
                     for c in body["calls"]]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return web.json_response({"error": f"bad request: {type(e).__name__}"}, status=400)
        replies = [calculator.run_call(c) for c in calls]
        return web.json_response({"replies": [{"text": t, "ok": ok} for t, ok in replies]})

    async def health(request):
        return web.Response(text="ok")

    app = web.Application(client_max_size=64 * 1024)
    app.add_routes([web.post("/step", step), web.get("/health", health)])
    return app


async def _serve(host: str, port_file: Path, api_key: str, parent: int) -> None:
    from aiohttp import web

    runner = web.AppRunner(make_app(api_key), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    port = runner.addresses[0][1]
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(str(port))
    tmp.replace(port_file)  # whole or absent: the starter never reads half a port
    while os.getppid() == parent:  # the run that started it is gone (even after kill -9): leave too
        await asyncio.sleep(1.0)
    await runner.cleanup()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="the calculator example's environment server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port-file", required=True, help="where to write the port it bound")
    ap.add_argument("--parent", type=int, default=os.getppid(), help="exit when this process is gone")
    args = ap.parse_args(argv)
    key = os.environ.get(KEY_ENV)
    if not key:
        print(f"http_env: set {KEY_ENV} (the API key clients send)", file=sys.stderr)
        return 2
    if args.host in ("0.0.0.0", "::"):
        print("http_env: bind to this node's address, not every interface", file=sys.stderr)
        return 2
    asyncio.run(_serve(args.host, Path(args.port_file), key, args.parent))
    return 0


# -- the trainer's side: the rollout function --------------------------------------------------------------
class EnvServer:
    """One environment server per process, started on first use and stopped at exit."""

    _started: Optional["EnvServer"] = None
    _lock = threading.Lock()  # groups start concurrently: one server for all of them

    def __init__(self, host: str = "127.0.0.1"):
        self.api_key = secrets.token_hex(16)
        self.dir = tempfile.mkdtemp(prefix="m2po-http-env-")
        port_file = Path(self.dir) / "port"
        self.proc = subprocess.Popen([sys.executable, "-m", "m2po_megatron.examples.http_env", "--host", host,
                                      "--port-file", str(port_file), "--parent", str(os.getpid())],
                                     env=dict(os.environ, **{KEY_ENV: self.api_key}))
        atexit.register(self.stop)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the example's environment server did not start (exit {self.proc.returncode})")
            time.sleep(0.05)
        self.url = f"http://{host}:{int(port_file.read_text())}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    @classmethod
    def stop_shared(cls) -> None:
        with cls._lock:
            if cls._started is not None:
                cls._started.stop()
                cls._started = None

    @classmethod
    def shared(cls) -> "EnvServer":
        with cls._lock:
            if cls._started is None or cls._started.proc.poll() is not None:
                cls._started = cls()
            return cls._started


class HttpExecutor:
    """calculator's tool execution, sent to the environment server."""

    def __init__(self, url: str, api_key: str, timeout_s: float = 30.0):
        self.url, self.headers, self.timeout_s = url, {"Authorization": f"Bearer {api_key}"}, timeout_s

    async def __call__(self, calls: list[ToolCall]) -> list[tuple[str, bool]]:
        import aiohttp

        body = {"calls": [{"name": c.name, "arguments": c.arguments, "error": c.error} for c in calls]}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as s:
            async with s.post(f"{self.url}/step", json=body, headers=self.headers) as r:
                if r.status != 200:  # raised: the runner drops the group as `error`, naming this
                    raise RuntimeError(f"environment server {self.url}/step answered {r.status}")
                return [(x["text"], bool(x["ok"])) for x in (await r.json())["replies"]]


async def rollout(ctx: RolloutContext) -> list[RolloutResult]:
    """The calculator's episodes, with every tool call answered by the environment server."""
    if ctx.args.get("env_url"):
        key = os.environ.get(str(ctx.args.get("env_api_key_env", KEY_ENV)), "")
        execute = HttpExecutor(str(ctx.args["env_url"]), key)
    else:
        server = await asyncio.get_running_loop().run_in_executor(None, EnvServer.shared)
        execute = HttpExecutor(server.url, server.api_key)
    return await calculator.rollout_with(ctx, execute)


if __name__ == "__main__":
    sys.exit(main())
