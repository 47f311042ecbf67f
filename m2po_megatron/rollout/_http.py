"""Synchronous HTTP for the control plane (health checks, weight-sync calls) outside asyncio, on aiohttp like
the asyncio client, so the project has one HTTP stack. The calls run on one event loop in a daemon thread
(LoopThread), which SyncRolloutClient uses too."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading


def auth_headers(api_key: str | None) -> dict:
    """SGLang's --api-key: a bearer token (every endpoint but /health* checks it)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class LoopThread:
    """An asyncio event loop running in a daemon thread; submit() schedules a coroutine on it from any thread."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout: float = 10.0) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=timeout)


_loop: LoopThread | None = None
_loop_pid = 0
_loop_lock = threading.Lock()


def _control_loop() -> LoopThread:
    # One per process: a forked child (Ray worker, spawned rank) inherits the object but not its thread.
    global _loop, _loop_pid
    with _loop_lock:
        if _loop is None or _loop_pid != os.getpid():
            _loop, _loop_pid = LoopThread("control-http"), os.getpid()
        return _loop


async def _request(url: str, data: bytes | None, method: str, headers: dict, timeout: float) -> tuple[int, str]:
    import aiohttp

    # As a socket timeout: for connecting and for each read, not for the whole exchange.
    limits = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
    try:
        async with aiohttp.ClientSession(timeout=limits) as session:
            async with session.request(method, url, data=data, headers=headers) as r:
                return r.status, (await r.read()).decode(errors="replace")
    except aiohttp.InvalidURL:
        raise
    except asyncio.TimeoutError as e:
        raise TimeoutError(f"{method} {url}: no answer within {timeout} s") from e
    except aiohttp.ClientError as e:  # refused, reset, disconnected
        raise ConnectionError(f"{method} {url}: {e}") from e


def request(url: str, body: dict | None = None, *, api_key: str | None = None, timeout: float = 30.0,
            method: str | None = None) -> tuple[int, str]:
    """(status, text) for any status the server answers; connection problems and timeouts raise OSError
    (ConnectionError, TimeoutError), a malformed URL ValueError."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **auth_headers(api_key)}
    fut = _control_loop().submit(_request(url, data, method or ("GET" if body is None else "POST"), headers,
                                          timeout))
    return fut.result()


def post_ok(url: str, body: dict, *, api_key: str | None = None, timeout: float = 600.0) -> dict:
    """POST and require HTTP 200 and, when present, success=true; raise RuntimeError with the server's text."""
    status, text = request(url, body, api_key=api_key, timeout=timeout)
    try:
        out = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        out = {"message": text}
    if status != 200 or (isinstance(out, dict) and out.get("success") is False):
        raise RuntimeError(f"{url} answered {status}: {text[:500]}")
    return out if isinstance(out, dict) else {"result": out}
