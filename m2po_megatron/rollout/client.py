"""Asyncio client for SGLang servers (or our CPU server): pooled connections, per-server concurrency bounds,
least-outstanding balancing across servers, timeouts, bounded re-issue of requests whose server died.

    client = RolloutClient(["http://10.0.0.5:30000", ...], api_key=None)
    samples = await client.generate(prompt_ids, {"temperature": 1.0, "max_new_tokens": 512}, n=8)

From non-async code (e.g. the training loop's background generation) use SyncRolloutClient, which owns an
event loop in a daemon thread and returns concurrent.futures.Future objects."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import random
import time
import uuid
from typing import Any, Sequence

from m2po_megatron.agents.types import ServerUnavailable
from m2po_megatron.rollout import _http, protocol


@dataclasses.dataclass
class SampleResult:
    output_ids: list[int]
    output_logprobs: list[float]   # behaviour log-probs, one per output token (see sampling.py for semantics)
    token_versions: list[int]      # weight version that produced each output token
    finish_reason: str             # "stop" | "length" | "abort"
    prompt_tokens: int
    weight_version: int            # the server's version when the sample finished
    server: str = ""
    meta_info: dict = dataclasses.field(default_factory=dict, repr=False)
    routed_experts: str | None = dataclasses.field(default=None, repr=False)  # SGLang's base64 (routing.py)


@dataclasses.dataclass
class ClientStats:
    requests: int = 0      # sample requests issued by callers
    completed: int = 0
    reissued: int = 0      # attempts repeated on another (or the restarted) server after a failure
    failed: int = 0        # gave up after max_retries / no healthy server
    aborted: int = 0       # finished with finish_reason "abort" (pause mode abort, /abort_request)
    per_server: dict = dataclasses.field(default_factory=dict)


class RolloutFailed(ServerUnavailable):
    """A request could not be served by any server within the retry budget (a rollout function's runner lets it
    through: the servers' failure, not the function's)."""


class RolloutRequestError(ValueError):
    """The server refused the request (HTTP 4xx); retrying elsewhere would not help."""


_RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}


def version_to_int(v: Any, default: int = 0) -> int:
    """SGLang versions are strings; the trainer's are optimizer-step counts. "default" (never synced) -> default."""
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def sample_seeds(seed: int | None, n: int) -> list[int]:
    """The sampling_seed of each of a request's n samples: seed + i (mod 2**63, inside SGLang's int64 range),
    or random 62-bit seeds without one."""
    return [(seed + i) % 2**63 if seed is not None else random.getrandbits(62) for i in range(n)]


def build_generate_body(prompt_ids: Sequence[int], sampling_params: dict | None, rid: str,
                        return_logprob: bool = True, return_routed_experts: bool = False) -> dict:
    """The /generate body for one sample (n is expanded by the client). Raises ProtocolError early for what
    an SGLang server started with --skip-tokenizer-init would refuse. return_routed_experts (R3): the
    server's top-k expert ids of every fed position (rollout/routing.py); only sent when wanted."""
    sp = dict(sampling_params or {})
    sp.pop("n", None)
    body = {"rid": rid, "input_ids": [int(t) for t in prompt_ids], "sampling_params": sp,
            "return_logprob": bool(return_logprob)}
    if return_routed_experts:
        body["return_routed_experts"] = True
    protocol.validate_request("POST /generate", body)
    protocol.sampling_params(sp, tokenizer=False)
    return body


def build_batch_body(prompt_ids: Sequence[int], sampling_params: dict | None, seeds: Sequence[int],
                     return_logprob: bool = True, return_routed_experts: bool = False) -> dict:
    """One /generate body for a prompt's len(seeds) samples in SGLang's batch form (lists of input_ids,
    sampling_params and rid, one entry per sample, each with its own sampling_seed): one HTTP round trip
    and one arrival at the server, so the samples join the running batch together. SGLang answers a list."""
    one = [build_generate_body(prompt_ids, dict(sampling_params or {}, sampling_seed=s), "", return_logprob)
           for s in seeds]
    body = {"rid": [uuid.uuid4().hex for _ in one], "input_ids": [b["input_ids"] for b in one],
            "sampling_params": [b["sampling_params"] for b in one], "return_logprob": bool(return_logprob)}
    if return_routed_experts:  # a bool for the whole batch, as GenerateReqInput reads it
        body["return_routed_experts"] = True
    protocol.validate_request("POST /generate", body)
    return body


class _Slots:
    """A weighted semaphore: acquire(k) waits until k of `limit` slots are free (a request larger than the
    limit waits for all of them), so max_concurrency counts samples whether they come one or n per request.
    release() is synchronous, so a cancelled request gives its slots back in a `finally` without awaiting."""

    def __init__(self, limit: int):
        self.limit = max(1, int(limit))
        self.free = self.limit
        self._waiters: list[asyncio.Future] = []

    async def acquire(self, k: int) -> int:
        k = min(max(1, k), self.limit)
        while self.free < k:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                self._waiters.remove(fut)
        self.free -= k
        return k

    def release(self, k: int) -> None:
        self.free += k
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)


class _Server:
    def __init__(self, url: str, limit: int):
        self.url = url.rstrip("/")
        self.slots = _Slots(limit)
        self.outstanding = 0
        self.down_until = 0.0
        self.errors = 0
        self.completed = 0


class RolloutClient:
    def __init__(self, urls: Sequence[str], *, api_key: str | None = None, max_concurrency_per_server: int = 64,
                 request_timeout_s: float = 3600.0, connect_timeout_s: float = 10.0, max_retries: int = 5,
                 retry_backoff_s: float = 0.5, wait_for_server_s: float = 300.0, initial_version: int = 0):
        if not urls:
            raise ValueError("RolloutClient needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.api_key = api_key
        self.limit = max_concurrency_per_server
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.wait_for_server_s = wait_for_server_s
        self.initial_version = initial_version
        self.stats = ClientStats()
        self._servers: list[_Server] | None = None
        self._session = None
        self._rr = itertools.count()

    # ------------------------------------------------------------------ plumbing
    async def _ensure(self):
        import aiohttp

        if self._session is None:
            self._servers = [_Server(u, self.limit) for u in self.urls]
            conn = aiohttp.TCPConnector(limit=0, limit_per_host=self.limit + 8, keepalive_timeout=60)
            self._session = aiohttp.ClientSession(connector=conn, headers=_http.auth_headers(self.api_key))
        return self._session

    def _timeout(self, total: float | None = None):
        import aiohttp

        return aiohttp.ClientTimeout(total=total or self.request_timeout_s, sock_connect=self.connect_timeout_s)

    async def close(self) -> None:
        # Requests still in flight (a run ending mid-generation) are cancelled first, so none of them
        # fails later against a closed session.
        me = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self):
        await self._ensure()
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def _probe(self, srv: _Server) -> bool:
        import aiohttp

        try:
            async with self._session.get(f"{srv.url}/health", timeout=self._timeout(5.0)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _pick(self, prefer: str | None = None) -> _Server:
        """Least outstanding among servers not marked down (`prefer`, a server's URL, while it is up: the turns
        of one episode reuse its prefix cache); when all are down, poll /health until one is back (a restarted
        server) or wait_for_server_s passes."""
        deadline = time.monotonic() + self.wait_for_server_s
        while True:
            now = time.monotonic()
            up = [s for s in self._servers if s.down_until <= now]
            if prefer is not None:
                for s in up:
                    if s.url == prefer:
                        return s
            if up:
                k = next(self._rr)
                return min(up, key=lambda s: (s.outstanding, (self._servers.index(s) - k) % len(self._servers)))
            for s in self._servers:
                if await self._probe(s):
                    s.down_until = 0.0
            if not any(s.down_until == 0.0 for s in self._servers):
                if time.monotonic() > deadline:
                    raise RolloutFailed(f"no healthy rollout server within {self.wait_for_server_s:.0f} s: {self.urls}")
                await asyncio.sleep(0.5)

    def _per_server(self):
        self.stats.per_server = {s.url: {"outstanding": s.outstanding, "completed": s.completed,
                                         "errors": s.errors, "down": s.down_until > time.monotonic()}
                                 for s in self._servers}

    async def _post_generate(self, body: dict, prefer: str | None = None) -> tuple[dict | list, str]:
        """POST one body (a single sample, or a batch of them) to the least loaded server (or `prefer`, while it
        is up); `outstanding`, `completed`, `errors` and the re-issue count are in samples."""
        import aiohttp

        size = len(body["rid"]) if isinstance(body.get("rid"), list) else 1

        await self._ensure()
        attempt = 0
        while True:
            try:
                srv = await self._pick(prefer)
            except RolloutFailed:
                self.stats.failed += 1
                raise
            srv.outstanding += size
            self._per_server()
            held = 0
            try:
                held = await srv.slots.acquire(size)
                async with self._session.post(f"{srv.url}/generate", json=body, timeout=self._timeout()) as r:
                    if r.status == 200:
                        out = await r.json()
                        srv.completed += size
                        return out, srv.url
                    text = await r.text()
                    if r.status not in _RETRYABLE_STATUS:
                        raise RolloutRequestError(f"{srv.url}/generate answered {r.status}: {text[:500]}")
                    raise aiohttp.ClientResponseError(r.request_info, (), status=r.status, message=text[:200])
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                srv.errors += size
                srv.down_until = time.monotonic() + 3600  # until a /health probe sees it again
                attempt += 1
                if attempt > self.max_retries:
                    self.stats.failed += 1
                    raise RolloutFailed(f"request {body.get('rid')} failed {attempt} times; last: {e!r}") from e
                self.stats.reissued += size
                await asyncio.sleep(self.retry_backoff_s)
            finally:
                if held:
                    srv.slots.release(held)
                srv.outstanding -= size
                self._per_server()

    def _parse(self, resp: dict, url: str) -> SampleResult:
        ids = list(resp["output_ids"])
        meta = resp.get("meta_info", {})
        lps = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
        versions = [version_to_int(v, self.initial_version) for v in protocol.expand_weight_versions(meta, len(ids))]
        fr = meta.get("finish_reason") or {}
        reason = fr.get("type", "abort") if isinstance(fr, dict) else str(fr)
        if reason == "abort":
            self.stats.aborted += 1
        return SampleResult(output_ids=ids, output_logprobs=lps, token_versions=versions, finish_reason=reason,
                            prompt_tokens=int(meta.get("prompt_tokens", 0)),
                            weight_version=version_to_int(meta.get("weight_version"), self.initial_version),
                            server=url, meta_info=meta, routed_experts=meta.get("routed_experts"))

    # ------------------------------------------------------------------ public
    async def generate(self, prompt_ids: Sequence[int], sampling_params: dict | None = None, n: int = 1,
                       return_logprob: bool = True, return_routed_experts: bool = False,
                       server: str | None = None) -> list[SampleResult]:
        """n samples of one prompt (token ids), sent as one batch request to one server (a group's samples
        share its prompt, and SGLang's prefix cache shares the prompt's KV on one server; the per-sample
        overhead of HTTP and of trickling into the running batch is paid once per prompt). With sampling_seed
        s, sample i uses s + i; without one each sample gets a random seed, because a server with
        deterministic inference would give every unseeded request the same seed (42) and so the same sample.
        server: a URL of this client's servers to send to while it is up (an episode's later turns)."""
        sp = dict(sampling_params or {})
        n = int(sp.pop("n", n) if n == 1 else n)
        seeds = sample_seeds(sp.get("sampling_seed"), n)
        self.stats.requests += n
        if n == 1:
            resp, url = await self._post_generate(
                build_generate_body(prompt_ids, dict(sp, sampling_seed=seeds[0]), uuid.uuid4().hex, return_logprob,
                                    return_routed_experts), server)
            resps = [resp]
        else:
            resps, url = await self._post_generate(build_batch_body(prompt_ids, sp, seeds, return_logprob,
                                                                    return_routed_experts), server)
            if not isinstance(resps, list) or len(resps) != n:
                raise RolloutFailed(f"{url}/generate answered {type(resps).__name__} for a batch of {n} "
                                    "samples; SGLang answers a list with one entry per sample")
        results = [self._parse(r, url) for r in resps]
        self.stats.completed += n
        return results

    async def _broadcast(self, path: str, body: dict | None = None) -> list[dict]:
        await self._ensure()
        if body is not None:
            protocol.validate_request(f"POST {path}", body)

        async def one(srv):
            async with self._session.post(f"{srv.url}{path}", json=body or {}, timeout=self._timeout(600)) as r:
                text = await r.text()
                if r.status != 200:
                    raise RuntimeError(f"{srv.url}{path} answered {r.status}: {text[:300]}")
                return {"url": srv.url, "status": r.status, "text": text}

        return await asyncio.gather(*(one(s) for s in self._servers))

    async def pause(self, mode: str = "retract") -> None:
        """POST /pause_generation on every server. retract: keep requests, recompute their KV after the update;
        abort: finish running requests with finish_reason "abort"; in_place: freeze them with their KV."""
        await self._broadcast("/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._broadcast("/continue_generation", {})

    async def abort_all(self) -> None:
        await self._broadcast("/abort_request", {"abort_all": True})

    async def health(self) -> dict[str, bool]:
        await self._ensure()
        return {s.url: await self._probe(s) for s in self._servers}


class SyncRolloutClient:
    """RolloutClient on its own event loop in a daemon thread, for synchronous callers.

        client = SyncRolloutClient(urls)
        fut = client.submit(prompt_ids, {"max_new_tokens": 256}, n=8)   # concurrent.futures.Future
        samples = fut.result()                                        # list[SampleResult]
    """

    def __init__(self, urls: Sequence[str], **kwargs):
        self._loop = _http.LoopThread("rollout-client")
        self.client = RolloutClient(urls, **kwargs)

    def _call(self, coro) -> concurrent.futures.Future:
        return self._loop.submit(coro)

    def submit(self, prompt_ids, sampling_params=None, n: int = 1, return_logprob: bool = True,
               return_routed_experts: bool = False):
        return self._call(self.client.generate(prompt_ids, sampling_params, n, return_logprob,
                                               return_routed_experts))

    def generate(self, prompt_ids, sampling_params=None, n: int = 1, return_logprob: bool = True,
                 timeout: float | None = None, return_routed_experts: bool = False) -> list[SampleResult]:
        return self.submit(prompt_ids, sampling_params, n, return_logprob, return_routed_experts).result(timeout)

    def run(self, fn) -> concurrent.futures.Future:
        """fn(RolloutClient) -> coroutine, run on this client's event loop (rollout functions, agents/runner.py)."""
        return self._call(fn(self.client))

    def pause(self, mode: str = "retract", timeout: float | None = 600) -> None:
        self._call(self.client.pause(mode)).result(timeout)

    def continue_generation(self, timeout: float | None = 600) -> None:
        self._call(self.client.continue_generation()).result(timeout)

    def abort_all(self, timeout: float | None = 600) -> None:
        self._call(self.client.abort_all()).result(timeout)

    @property
    def stats(self) -> ClientStats:
        return self.client.stats

    def close(self) -> None:
        if self._loop.loop.is_running():
            self._call(self.client.close()).result(30)
            self._loop.stop()
