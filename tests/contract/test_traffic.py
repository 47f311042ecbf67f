"""Every request the project sends, taken off the wire, is one SGLang's HTTP layer accepts.

The project's own code paths (the training generator with the tiny-cpu recipe's sampling, eval generation,
pause/continue/abort of the client, a whole weight sync with its group, session and buckets, the launcher's
health wait) talk to the CPU server through a recording proxy; every recorded request is then replayed to
SGLang's HTTP layer, which must parse it and answer the status the CPU server answered."""
import asyncio
import json
import pathlib
import threading

import pytest
import torch

from tests.contract.conftest import CONTEXT

pytestmark = pytest.mark.timeout(600)
ROOT = pathlib.Path(__file__).resolve().parents[2]


class RecordingProxy:
    """HTTP proxy on 127.0.0.1 (a free port the kernel picks) that forwards to `upstream` and records
    (method, path with query, JSON body or None, status)."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.records: list[tuple[str, str, object, int]] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(60)

    async def _start(self):
        import aiohttp
        from aiohttp import web

        self.session = aiohttp.ClientSession()

        async def forward(request):
            raw = await request.read()
            headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
            async with self.session.request(request.method, self.upstream + request.path_qs, data=raw,
                                            headers=headers, timeout=aiohttp.ClientTimeout(total=600)) as r:
                body = await r.read()
                self.records.append((request.method, request.path_qs, json.loads(raw) if raw.strip() else None,
                                     r.status))
                return web.Response(body=body, status=r.status, content_type=r.content_type)

        app = web.Application(client_max_size=1 << 31)
        app.router.add_route("*", "/{tail:.*}", forward)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    def close(self):
        async def stop():
            await self.session.close()
            await self.runner.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _project_traffic(url: str, tiny_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from m2po_megatron.config import load_config
    from m2po_megatron.eval.rollout_generate import rollout_generate_fn
    from m2po_megatron.agents.runner import sampling_params
    from m2po_megatron.rollout.generators import GroupMaker
    from m2po_megatron.rollout.client import SyncRolloutClient
    from m2po_megatron.rollout.launcher import wait_healthy
    from m2po_megatron.convert.export import hf_buckets
    from m2po_megatron.rollout.weight_sync import DistributedWeightSync
    from m2po_megatron.rollout.samples import Group

    cfg = load_config(ROOT / "recipes" / "tiny-cpu.yaml", [f"rollout.max_new_tokens={CONTEXT // 4}",
                                                          f"model.hf_path={tiny_model_dir}"], check_files=False)
    wait_healthy(url, timeout_s=120)
    client = SyncRolloutClient([url])
    try:
        maker = GroupMaker(client, None, None, None, sampling_params(cfg), n=2, seed=cfg.run.seed)
        maker.submit(Group(group_id="g0", prompt_id="p0", prompt_ids=[5, 6, 7], answer="1")).result(300)
        generate = rollout_generate_fn(client, seed=cfg.run.seed)
        generate([[4, 5], [6]], 2, cfg.eval.temperature, cfg.eval.top_p, CONTEXT // 4)
        for mode in ("retract", "in_place", "abort"):
            client.pause(mode)
            client.continue_generation()
        client.abort_all()
    finally:
        client.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for mode in ("retract", "in_place"):
        sync = DistributedWeightSync([url], backend="gloo", timeout_s=120, pause_mode=mode,
                                     group_name=f"traffic_{mode}")
        sync.init_group()
        try:
            sync.sync(hf_buckets(model.named_parameters(), bucket_bytes=40_000), weight_version=1)
        finally:
            sync.close()


def test_every_request_the_project_sends_is_accepted_by_sglang(cpu_server, sglang_http, tiny_model_dir):
    proxy = RecordingProxy(cpu_server.url)
    try:
        _project_traffic(proxy.url, tiny_model_dir)
    finally:
        proxy.close()
    seen = {(m, p.split("?")[0]) for m, p, _, _ in proxy.records}
    for endpoint in ["GET /health_generate", "GET /get_server_info", "POST /generate", "POST /pause_generation",
                     "POST /continue_generation", "POST /abort_request", "POST /init_weights_update_group",
                     "POST /begin_weight_update", "POST /update_weights_from_distributed",
                     "POST /end_weight_update", "POST /destroy_weights_update_group"]:
        assert tuple(endpoint.split()) in seen, f"the project's traffic never used {endpoint}"
    for method, path, body, status in proxy.records:
        assert status == 200, f"the CPU server refused the project's {method} {path} {body!r:.300}"
        want, text = sglang_http.request(method, path, body)
        assert want == 200, f"SGLang refuses the project's {method} {path} {body!r:.300}: {text[:500]}"
    modes = [b["mode"] for m, p, b, _ in proxy.records if p == "/pause_generation"]
    assert {"retract", "in_place", "abort"} <= set(modes)
    flushes = [b["flush_cache"] for m, p, b, _ in proxy.records if p == "/update_weights_from_distributed"]
    assert True in flushes and flushes.count(True) == 1  # only the retract sync's last bucket flushes
