"""A reward service over HTTP (recipe `reward.function: remote`, args in remote_protocol.RemoteArgs): a reward
model served by SGLang, an OpenAI-compatible judge, or a user's own service. docs/reward-service.md.

`RemoteReward(args).score(items)` blocks its caller (the generation thread) while the batches go out on an
event loop of its own, in a daemon thread: at most `max_concurrency` requests in flight, each bounded by
`timeout_s`, retried `max_retries` times with exponential backoff and jitter when the failure may pass
(timeout, connection, 429, 5xx). A service that fails never raises here: the item's score is None, its
status the reason (timeout, connection, http_<code>, bad_response), counted in stats() as failed/<reason>;
the recipe's reward.on_error then scores or drops the sample. The API key is read from the environment
variable args.api_key_env names and only ever sent as a bearer header: it is in no log, message or stat.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import os
import random
import threading
import time
from collections import Counter
from typing import Optional

from .remote_protocol import (BadResponse, RemoteArgs, build_body, check_args, display_url, encode, endpoint,
                              headers, parse_answer)
from .types import RewardInput, RewardOutput

log = logging.getLogger(__name__)

# Reported by every stats() call, zero or not, so a run's metrics have the same keys at every step.
BASE_COUNTERS = ("items", "scored", "failed", "requests", "retries")


def retryable(reason: str) -> bool:
    """A failure that may pass: no answer in time, no connection, too many requests, a server error. Other
    4xx (a bad key, a request the service refuses) would fail the same way again."""
    if reason in ("timeout", "connection", "http_429"):
        return True
    return reason.startswith("http_5")


class RemoteReward:
    """The `remote` reward term: `score(items) -> list[RewardOutput]` in order, `stats()`, `close()`."""

    def __init__(self, args: dict):
        errors = check_args(args)
        if errors:
            raise ValueError("the reward service's args: " + "; ".join(errors))
        self.args = a = RemoteArgs.from_args(dict(args))
        self.url = endpoint(a)
        self.where = display_url(self.url)  # what messages name: no query string, no credential
        key = os.environ.get(a.api_key_env) if a.api_key_env else None
        self._key = key or None
        self._headers = headers(self._key)
        self._lock = threading.Lock()
        self._counts: Counter = Counter()
        self._seconds = 0.0
        self._warned: set[str] = set()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._pid = 0
        self._session = None  # aiohttp.ClientSession, made on the loop at first use
        self._sem: Optional[asyncio.Semaphore] = None
        self._closed = False

    check_args = staticmethod(check_args)

    # -- the caller's side ----------------------------------------------------------------------------------
    def score(self, items: list[RewardInput]) -> list[RewardOutput]:
        """A verdict per item, in order; blocks at most about deadline_s(len(items)) whatever the service does."""
        if not items:
            return []
        if threading.current_thread() is self._thread:
            raise RuntimeError("RemoteReward.score() was called from its own event loop; call it from a thread")
        loop = self._ensure_loop()
        t0 = time.monotonic()
        groups = self._batches(len(items))
        deadline = self.deadline_s(len(items))
        fut = asyncio.run_coroutine_threadsafe(self._score_all(items, groups, deadline), loop)
        try:
            # the coroutine stops itself at `deadline`; this wait is only a guard against a stuck loop
            outs = fut.result(timeout=deadline + 30.0)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            outs = [RewardOutput(None, status="timeout", detail=f"no verdict within {deadline:.0f} s")
                    for _ in items]
        self._record(outs, time.monotonic() - t0)
        return outs

    def deadline_s(self, n_items: int) -> float:
        """The most one score() call may take: its waves of requests, each of at most 1 + max_retries
        attempts of timeout_s and max_retries backoffs (a margin of one timeout_s on top)."""
        a = self.args
        waves = math.ceil(len(self._batches(n_items)) / a.max_concurrency)
        per_batch = (1 + a.max_retries) * a.timeout_s + a.max_retries * a.max_backoff_s
        return waves * per_batch + a.timeout_s

    def stats(self) -> dict[str, float]:
        """Counters since the previous call: items, scored, failed, failed/<reason>, requests (attempts sent),
        retries, retried/<reason> (attempts that failed and were tried again), seconds (inside score())."""
        with self._lock:
            out = {k: float(self._counts.get(k, 0)) for k in BASE_COUNTERS}
            out.update({k: float(v) for k, v in self._counts.items()})
            out["seconds"] = self._seconds
            self._counts.clear()
            self._seconds = 0.0
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or self._pid != os.getpid():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close_session(), loop).result(timeout=10)
        except Exception:  # a loop that cannot close its session is stopped all the same
            pass
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if not thread.is_alive():
            loop.close()

    def __enter__(self) -> "RemoteReward":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------------------
    def _batches(self, n: int) -> list[range]:
        size = 1 if self.args.kind == "openai_judge" else self.args.batch_size
        return [range(i, min(i + size, n)) for i in range(0, n, size)]

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._closed:
                raise RuntimeError("RemoteReward is closed")
            if self._loop is None or self._pid != os.getpid():  # a forked child has the object, not the thread
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="reward-remote", daemon=True)
                self._thread.start()
                self._pid, self._session, self._sem = os.getpid(), None, None
            return self._loop

    def _record(self, outs: list[RewardOutput], seconds: float) -> None:
        with self._lock:
            self._seconds += seconds
            self._counts["items"] += len(outs)
            for o in outs:
                if o.score is None:
                    self._counts["failed"] += 1
                    self._counts[f"failed/{o.status}"] += 1
                else:
                    self._counts["scored"] += 1
        for o in outs:
            if o.score is None and o.status not in self._warned:
                self._warned.add(o.status)  # once per reason: a service down for an hour logs one line
                log.warning("reward service %s: %s (%s); counted as failed/%s, the sample scored or dropped as "
                            "reward.on_error says", self.where, o.status, o.detail, o.status)

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def _scrub(self, text: str) -> str:
        """A server's message, shortened, with the key cut out should the server echo it back."""
        text = " ".join(text.split())[:200]
        return text.replace(self._key, "***") if self._key else text

    async def _score_all(self, items: list[RewardInput], groups: list[range], deadline: float) -> list[RewardOutput]:
        outs: list[Optional[RewardOutput]] = [None] * len(items)
        tasks = {asyncio.ensure_future(self._score_batch([items[i] for i in g])): g for g in groups}
        done, pending = await asyncio.wait(tasks, timeout=deadline)
        for t in pending:
            t.cancel()
        for t, g in tasks.items():
            if t in done:
                verdicts = t.result()  # an exception here is a bug of ours, raised to the caller
            else:
                verdicts = [RewardOutput(None, status="timeout", detail=f"no verdict within {deadline:.0f} s")
                            for _ in g]
            for i, v in zip(g, verdicts):
                outs[i] = v
        return outs  # type: ignore[return-value]

    async def _score_batch(self, items: list[RewardInput]) -> list[RewardOutput]:
        a = self.args
        body = encode(build_body(a, items))
        reason = detail = ""
        retry_after = None  # set by every attempt; read only by the next one
        for attempt in range(1 + a.max_retries):
            if attempt:
                self._count("retries")
                self._count(f"retried/{reason}")
                await asyncio.sleep(self._backoff(attempt, retry_after))
            async with self._semaphore():
                self._count("requests")
                reason, detail, text, retry_after = await self._post(body)
            if not reason:
                try:
                    verdicts = parse_answer(a, text, len(items))
                except BadResponse as e:  # the same request would get the same answer: not retried
                    reason, detail = "bad_response", self._scrub(str(e))
                    break
                return [RewardOutput(s, extras) if s is not None
                        else RewardOutput(None, status="bad_response", detail=self._scrub(why))
                        for s, extras, why in verdicts]
            if not retryable(reason):
                break
        return [RewardOutput(None, status=reason, detail=detail) for _ in items]

    def _semaphore(self) -> asyncio.Semaphore:
        if self._sem is None:  # made on the loop that uses it
            self._sem = asyncio.Semaphore(self.args.max_concurrency)
        return self._sem

    async def _post(self, body: bytes) -> tuple[str, str, str, Optional[float]]:
        """(failure reason or "", detail, answer text, Retry-After seconds) of one attempt."""
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.args.max_concurrency))
        timeout = aiohttp.ClientTimeout(total=self.args.timeout_s)
        try:
            # no redirects: a redirect would carry the bearer key to wherever the service points
            async with self._session.post(self.url, data=body, headers=self._headers, timeout=timeout,
                                          allow_redirects=False) as r:
                raw = await r.read()
                status, retry_after = r.status, _seconds(r.headers.get("Retry-After"))
        except asyncio.TimeoutError:  # before ClientError: aiohttp's timeouts are both
            return "timeout", f"no answer from {self.where} within {self.args.timeout_s} s", "", None
        except (aiohttp.ClientError, OSError) as e:
            return "connection", f"{type(e).__name__} to {self.where}: {self._scrub(str(e))}", "", None
        text = raw.decode(errors="replace")
        if 200 <= status < 300:
            return "", "", text, None
        return f"http_{status}", f"HTTP {status} from {self.where}: {self._scrub(text)}", "", retry_after

    def _backoff(self, attempt: int, retry_after: Optional[float]) -> float:
        """backoff_s doubled per retry, capped at max_backoff_s, jittered to 50-100 % so that clients that
        failed together do not retry together; at least a 429/503's Retry-After (under the same cap)."""
        a = self.args
        delay = min(a.max_backoff_s, a.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
        if retry_after is not None:
            delay = max(delay, min(retry_after, a.max_backoff_s))
        return delay

    async def _close_session(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _seconds(value: Optional[str]) -> Optional[float]:
    """Retry-After in seconds (its HTTP-date form is ignored: the backoff applies)."""
    try:
        v = float(value) if value is not None else None
    except ValueError:
        return None
    return v if v is not None and math.isfinite(v) and v >= 0 else None
