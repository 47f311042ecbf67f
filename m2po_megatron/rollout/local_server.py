"""CPU stand-in for an SGLang 0.5.23 server: the same HTTP endpoints, request fields and responses (the subset
the project uses, see docs/rollout.md), so the client, weight sync and training loop are identical on a laptop.
Where the two could differ it MIRRORS SGLang, so a CPU test fails where a real server would: weight updates
only inside a /begin_weight_update ... /end_weight_update session, an update without a pause waits for every
running request (SGLang's model-update lock) so no sample changes version mid-sequence, over-length requests
and --skip-tokenizer-init refusals get HTTP 400, unknown top-level fields are ignored, sampling_seed counts
only with --enable-deterministic-inference, a cache flush or a memory release is refused while requests run,
and generation while memory is released (server_memory.py).

    python -m m2po_megatron.rollout.local_server --model-path DIR [--host 127.0.0.1] [--port 30000]
        [--api-key KEY] [--skip-tokenizer-init] [--random-seed N] [--context-length N]
        [--max-running-requests N] [--weight-version V] [--dtype float32] [--enable-deterministic-inference]
        [--allow-auto-truncate] [--enable-return-routed-experts]

Flags are named like SGLang's. There is no tokenizer: input_ids in, output_ids out."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import socket
import sys
import time
import uuid

from m2po_megatron.rollout.server_args import LISTEN_FD_ENV, check_args, parser
from m2po_megatron.rollout.server_memory import InjectedFaults, MemoryEndpoints
from m2po_megatron.rollout.server_weights import WeightEndpoints

log = logging.getLogger("m2po.local_server")

# Known SGLang /generate fields this server cannot honour: a non-default value is refused (400), not ignored.
_GENERATE_UNSUPPORTED = {"text": None, "input_embeds": None, "image_data": None, "video_data": None,
                         "audio_data": None, "stream": False, "logprob_start_len": None, "top_logprobs_num": None,
                         "token_ids_logprob": None, "return_hidden_states": False, "lora_path": None,
                         "lora_id": None, "custom_logit_processor": None, "session_params": None,
                         "sampling_logprobs_mode": None, "return_sampling_mask": None, "return_entropy": False}
_HEALTH_PATHS = ("/health", "/health_generate")


def _json_error(status: int, message: str):
    from aiohttp import web

    return web.json_response({"error": {"message": message, "code": status}, "success": False,
                              "message": message}, status=status)


class RWLock:
    """SGLang's model-update lock (srt/utils/aio_rwlock.py): every /generate holds a reader lock for its whole
    life; a weight update outside a pause takes the writer lock, so it waits for all running requests, and
    requests arriving while a writer waits queue behind it."""

    def __init__(self):
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    @contextlib.asynccontextmanager
    async def reader(self):
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and not self._waiting_writers)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def writer(self):
        async with self._cond:
            self._waiting_writers += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and not self._readers)
                self._writer = True
            finally:
                self._waiting_writers -= 1
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()

    def locked(self) -> bool:
        return self._writer or self._readers > 0


class LocalServer(WeightEndpoints, MemoryEndpoints):
    """The HTTP endpoints over one Engine; the weight-update ones are WeightEndpoints' (server_weights.py), the
    release and resume of memory MemoryEndpoints' (server_memory.py)."""

    def __init__(self, engine, args):
        self.engine = engine
        self.args = args
        self.groups: dict[str, object] = {}
        self.model_update = RWLock()
        self.unpaused = asyncio.Event()  # SGLang's is_pause, inverted: /generate waits while it is clear
        self.unpaused.set()
        self.held_by_pause = 0  # /generate requests waiting for continue_generation (in get_server_info)
        self.session: str | None = None  # the selector of the open weight-update session
        self._pause_lock = asyncio.Lock()
        self.faults = InjectedFaults()  # test-only, from M2PO_CPU_SERVER_FAIL/HOLD (server_memory.py)

    # ------------------------------------------------------------------ app
    def app(self):
        from aiohttp import web

        from m2po_megatron.rollout.protocol import routes

        @web.middleware
        async def auth(request, handler):
            return await self._auth_impl(request, handler)

        @web.middleware
        async def errors(request, handler):
            return await self._errors_impl(request, handler)

        app = web.Application(middlewares=[auth, errors], client_max_size=1 << 31)
        handlers = {"/health": self.health, "/health_generate": self.health_generate,
                    "/get_model_info": self.model_info, "/model_info": self.model_info,
                    "/get_server_info": self.server_info, "/server_info": self.server_info,
                    "/flush_cache": self.flush_cache, "/generate": self.generate,
                    "/init_weights_update_group": self.init_group,
                    "/destroy_weights_update_group": self.destroy_group,
                    "/begin_weight_update": self.begin_update, "/end_weight_update": self.end_update,
                    "/update_weights_from_distributed": self.update_distributed,
                    "/update_weights_from_tensor": self.update_tensor,
                    "/update_weight_version": self.update_weight_version,
                    "/pause_generation": self.pause, "/continue_generation": self.resume,
                    "/abort_request": self.abort, "/release_memory_occupation": self.release_memory,
                    "/resume_memory_occupation": self.resume_memory}
        table = routes()
        for path, handler in handlers.items():  # exactly SGLang's methods for each path
            for method in table[path]:
                app.router.add_route(method, path, handler)
        return app

    async def _auth_impl(self, request, handler):
        key = self.args.api_key
        if key and not request.path.startswith(_HEALTH_PATHS):
            got = request.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {key}".encode()):
                from aiohttp import web

                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def _errors_impl(self, request, handler):
        from m2po_megatron.rollout.protocol import ProtocolError

        try:
            return await handler(request)
        except (ProtocolError, ValueError, KeyError, json.JSONDecodeError) as e:
            return _json_error(400, str(e))

    async def _body(self, request, endpoint: str) -> dict:
        """As SGLang's HTTP layer: fields it does not know are ignored, wrong types are refused (400)."""
        from m2po_megatron.rollout.protocol import validate_request

        raw = await request.read()
        if not raw.strip():
            raise ValueError(f"{endpoint}: the request body is required (send {{}} for no fields)")
        return validate_request(endpoint, json.loads(raw), strict=False)

    @contextlib.asynccontextmanager
    async def _update_lock(self):
        """SGLang's rule for every weight-update call: while paused it runs at once (whoever paused holds the
        engine still); otherwise it takes the writer lock and so waits for every running request."""
        if not self.unpaused.is_set():
            yield
            return
        async with self.model_update.writer():
            yield

    # ------------------------------------------------------------------ health / info
    async def _paused_health(self):
        """As SGLang: its health check is a one-token generation, which waits while generation is paused, so
        a paused server answers 503 after SGLANG_HEALTH_CHECK_TIMEOUT seconds (20) unless it continues."""
        from aiohttp import web

        try:
            await asyncio.wait_for(self.unpaused.wait(), float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20)))
        except asyncio.TimeoutError:
            return web.Response(status=503)
        return None

    async def health(self, request):
        from aiohttp import web

        if not self.engine.alive():
            return _json_error(503, f"engine stopped: {self.engine.error!r}")
        return await self._paused_health() or web.Response(status=200)

    async def health_generate(self, request):
        from aiohttp import web

        if not self.engine.alive():
            return _json_error(503, f"engine stopped: {self.engine.error!r}")
        paused = await self._paused_health()
        if paused is not None:
            return paused
        refused = self.released_error("/health_generate", 503)  # its one-token generation could not run
        if refused is not None:
            return refused
        from m2po_megatron.rollout.engine import SamplingParams

        try:
            rid = "health-" + uuid.uuid4().hex
            [(seqs, fut)] = self._submit([([0], SamplingParams(max_new_tokens=1), 1, rid)])
            await asyncio.wait_for(self._wait(seqs, fut, rid), timeout=30)
        except asyncio.TimeoutError:
            return _json_error(503, "health_generate timed out")
        return web.Response(status=200)

    async def model_info(self, request):
        from aiohttp import web

        return web.json_response({"model_path": self.args.model_path, "tokenizer_path": None,
                                  "is_generation": True, "preferred_sampling_params": None,
                                  "weight_version": self.engine.weight_version, "has_image_understanding": False,
                                  "has_audio_understanding": False, "model_type": self.engine.model.config.model_type,
                                  "architectures": getattr(self.engine.model.config, "architectures", None)})

    async def server_info(self, request):
        from aiohttp import web

        info = {k: v for k, v in vars(self.args).items() if k != "api_key"}  # never echo the key
        info.update(version="m2po-local-cpu", engine="local", weight_version=self.engine.weight_version,
                    internal_states=[dict(self.engine.stats(), held_by_pause=self.held_by_pause)])
        return web.json_response(info)

    async def flush_cache(self, request):
        """GET/POST /flush_cache?timeout=S, as SGLang: the body is ignored; refused (400) unless nothing runs
        or waits; with a timeout, waits up to S seconds for that."""
        from aiohttp import web

        raw = request.query.get("timeout", "0")
        try:
            timeout = float(raw)
        except ValueError:
            timeout = -1.0
        if not timeout >= 0:
            return _json_error(400, f"query parameter timeout={raw!r} must be a number >= 0")
        deadline = time.monotonic() + timeout
        while not self.engine.idle():
            if time.monotonic() >= deadline:
                return web.Response(status=400, text="Timed out waiting for idle state." if timeout > 0
                                    else "Flush cache failed.\n")
            await asyncio.sleep(0.05)
        return web.Response(status=200, text="Cache flushed.\n")  # no prefix cache on CPU: nothing to drop

    def _flushed(self) -> bool:
        """SGLang's flush after a weight update: only when nothing runs (waiting requests count unless the
        engine is paused in place or retracted)."""
        return self.engine.idle(ignore_waiting=self.engine.paused)

    # ------------------------------------------------------------------ generation
    def _submit(self, jobs) -> list[tuple[list, asyncio.Future]]:
        """Submit a request's jobs to the engine in one call, so its samples join the batch at one step;
        each job's future is done when all its sequences are (set from the engine thread)."""
        loop = asyncio.get_running_loop()

        def waiter(n):
            fut, left = loop.create_future(), [n]
            if n == 0:
                fut.set_result(None)

            def mark():
                left[0] -= 1
                if left[0] == 0 and not fut.done():
                    fut.set_result(None)
            return fut, lambda seq: loop.call_soon_threadsafe(mark)

        waiters = [waiter(n) for _, _, n, _ in jobs]
        seqs = self.engine.submit_many([(p, sp, n, done, rid) for (p, sp, n, rid), (_, done) in zip(jobs, waiters)])
        return [(s, fut) for s, (fut, _) in zip(seqs, waiters)]

    async def _wait(self, seqs, fut, rid):
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:  # the client went away: stop spending compute on it
            self.engine.abort(rid)
            raise
        return seqs

    async def generate(self, request):
        from aiohttp import web

        from m2po_megatron.rollout import protocol
        from m2po_megatron.rollout.engine import request_params

        body = await self._body(request, "POST /generate")
        bad = [k for k, default in _GENERATE_UNSUPPORTED.items() if k in body and body[k] not in (default, False)]
        if bad:
            raise ValueError(f"/generate fields {bad} are not supported by the CPU server (no tokenizer, no "
                             "streaming, output logprobs only); send input_ids")
        ids = body.get("input_ids")
        if ids is None:
            raise ValueError("The engine initialized with skip_tokenizer_init=True cannot accept text prompts. "
                             "Please provide input_ids.")
        batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        if not all(prompts):
            raise ValueError("input_ids cannot be empty.")
        sps = body.get("sampling_params") or {}
        sps = sps if isinstance(sps, list) else [sps] * len(prompts)
        rids = body.get("rid")
        rids = rids if isinstance(rids, list) else [rids if not batch else None] * len(prompts)
        if len(sps) != len(prompts) or len(rids) != len(prompts):
            raise ValueError("sampling_params / rid lists must have one entry per prompt in input_ids")
        rlp = body.get("return_logprob") or False
        rlps = rlp if isinstance(rlp, list) else [rlp] * len(prompts)
        # SGLang: only a server started with --enable-return-routed-experts answers them; others ignore the field
        routed = bool(body.get("return_routed_experts")) and self.engine.router is not None
        jobs = []
        for p, raw, rid in zip(prompts, sps, rids):
            sp = protocol.sampling_params(raw, tokenizer=False, vocab_size=self.engine.vocab_size)
            kept, max_new = protocol.check_lengths(len(p), raw.get("max_new_tokens"), sp["max_new_tokens"],
                                                   self.engine.context_length,
                                                   allow_auto_truncate=self.args.allow_auto_truncate)
            jobs.append((p[:kept], request_params(sp, max_new), int(sp["n"]), rid or uuid.uuid4().hex))
        if not self.engine.alive():
            return _json_error(503, f"engine stopped: {self.engine.error!r}")
        self.held_by_pause += 1  # SGLang: new requests wait while generation is paused
        try:
            await self.unpaused.wait()
        finally:
            self.held_by_pause -= 1
        refused = self.released_error("/generate")  # checked after a pause: memory may go while it waits
        if refused is not None:
            return refused
        t0 = time.monotonic()
        async with self.model_update.reader():
            submitted = self._submit(jobs)
            results = await asyncio.gather(*(self._wait(seqs, fut, job[3])
                                             for (seqs, fut), job in zip(submitted, jobs)))
        out = []
        for seqs, want_lp in zip(results, rlps):
            for s in seqs:
                spans = protocol.spans_from_versions(s.versions, self.engine.weight_version)
                meta = {"id": s.rid, "finish_reason": s.finish, "prompt_tokens": len(s.prompt),
                        "completion_tokens": len(s.out), "cached_tokens": 0,
                        "weight_version": spans[-1]["version"], "weight_versions": spans,
                        "e2e_latency": time.monotonic() - t0}
                if want_lp:
                    meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(s.logprobs, s.out)]
                if routed and s.finish["type"] != "abort":  # SGLang collects them for finished requests only
                    meta["routed_experts"] = self.engine.router.encode(s.routed_experts())
                out.append({"output_ids": list(s.out), "meta_info": meta})
        single = not batch and int(sps[0].get("n") or 1) == 1
        return web.json_response(out[0] if single else out)

    async def abort(self, request):
        from aiohttp import web

        body = await self._body(request, "POST /abort_request")
        if body.get("abort_all"):
            n = self.engine.abort(None, body.get("abort_message") or "Abort request")
        elif body.get("rid"):
            n = self.engine.abort(body["rid"], body.get("abort_message") or "Abort request")
        else:
            n = 0
        return web.json_response({"success": True, "message": f"aborted {n} sequence(s)"})

    async def pause(self, request):
        from aiohttp import web

        body = await self._body(request, "POST /pause_generation")
        mode = body.get("mode", "abort")
        async with self._pause_lock:
            self.unpaused.clear()
            if mode == "abort":  # SGLang aborts everything and returns once no request holds the lock
                while True:
                    self.engine.abort(None, "Abort by pause_generation")
                    if not self.model_update.locked():
                        break
                    await asyncio.sleep(0.05)
            else:
                self.engine.pause(mode)
        return web.json_response({"success": True, "message": "Generation paused successfully."})

    async def resume(self, request):
        from aiohttp import web

        await self._body(request, "POST /continue_generation")
        async with self._pause_lock:
            self.engine.resume()
            self.unpaused.set()
        return web.json_response({"success": True, "message": "Generation continued successfully."})


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    check_args(args)
    import torch

    # One intra-op thread by default: the tiny model's kernels are too small to split, and a second OpenMP
    # thread spin-waits at every barrier whenever the other core runs the trainer or the loop (a tiny-cpu step
    # spent 0.70 s in generation with two threads, 0.29 s with one: docs/training.md).
    torch.set_num_threads(int(os.environ.get("M2PO_CPU_SERVER_THREADS", "1")))
    from aiohttp import web

    from m2po_megatron.infra import trace
    from m2po_megatron.rollout.engine import Engine, load_model

    if args.random_seed is not None:
        torch.manual_seed(args.random_seed)
    model = load_model(args.model_path, args.dtype)
    longest = getattr(model.config, "max_position_embeddings", None)
    if args.context_length and longest and args.context_length > longest:  # SGLang refuses it at start-up too
        sys.exit(f"--context-length {args.context_length} is longer than the model's max_position_embeddings "
                 f"{longest}; use at most {longest}")
    engine = Engine(model, weight_version=args.weight_version, max_running_requests=args.max_running_requests or 256,
                    context_length=args.context_length, random_seed=args.random_seed,
                    deterministic=args.enable_deterministic_inference,
                    return_routed_experts=args.enable_return_routed_experts)

    async def start():
        server = LocalServer(engine, args)
        runner = web.AppRunner(server.app(), access_log=None)
        await runner.setup()
        fd = os.environ.pop(LISTEN_FD_ENV, None)
        if fd:  # a socket the launcher bound for us: no window in which another process could take the port
            sock = socket.socket(fileno=int(fd))
            args.port = sock.getsockname()[1]
            await web.SockSite(runner, sock).start()
        else:
            await web.TCPSite(runner, args.host, args.port).start()
        trace.open_from_env(f"server_{args.port}", f"rollout server :{args.port}")  # the run's timeline
        log.info("serving %s on http://%s:%d (auth %s)", args.model_path, args.host, args.port,
                 "on" if args.api_key else "off")
        print(f"The server is fired up and ready to roll! http://{args.host}:{args.port}", flush=True)
        return runner

    loop = asyncio.new_event_loop()
    runner = loop.run_until_complete(start())
    try:
        import signal

        loop.add_signal_handler(signal.SIGTERM, loop.stop)
        loop.run_forever()
    except KeyboardInterrupt:
        pass
    finally:
        loop.run_until_complete(runner.cleanup())
        engine.shutdown()
        trace.close_trace()
    return 0


if __name__ == "__main__":
    sys.exit(main())
