"""A server killed mid-run: its requests are re-issued on the other server and counted; the killed server is
restarted (bounded) and serves again. Start errors are clear and come before anything starts."""
import asyncio
import os
import socket

import pytest

from m2po_megatron.rollout.client import RolloutClient
from m2po_megatron.rollout.launcher import ServerSpec, ServerStartError, preflight
from tests.rollout.conftest import local_server

pytestmark = pytest.mark.timeout(280)


def test_killed_server_requests_are_reissued_and_server_restarts(tiny_model_dir, tmp_path):
    with local_server(tiny_model_dir, tmp_path, max_restarts=1) as a, local_server(tiny_model_dir, tmp_path) as b:

        async def scenario():
            async with RolloutClient([a.url, b.url], max_retries=3, retry_backoff_s=0.1) as client:
                sp = {"max_new_tokens": 200, "ignore_eos": True}
                tasks = [asyncio.create_task(client.generate([5 + i, 6, 7], sp, n=1)) for i in range(6)]
                while client.stats.per_server.get(a.url, {}).get("outstanding", 0) == 0:
                    await asyncio.sleep(0.05)
                a.kill()  # at once: 200 tokens cannot finish first, so at least one request must be re-issued
                results = await asyncio.gather(*tasks)
                return results, client.stats

        results, stats = asyncio.run(scenario())
        assert all(len(r[0].output_ids) == 200 for r in results)
        assert stats.reissued >= 1 and stats.failed == 0 and stats.completed == 6
        assert all(r[0].server == b.url for r in results if r[0].server != a.url)
        # the watchdog restarts the killed server once (max_restarts=1) and it serves again
        import time

        deadline = time.monotonic() + 180
        while not (a.restarts == 1 and a.alive() and a.last_error is None):
            assert time.monotonic() < deadline, a.info()
            time.sleep(0.5)
        from m2po_megatron.rollout.launcher import wait_healthy

        wait_healthy(a.url, timeout_s=120)
        out = asyncio.run(_one(a.url))
        assert out.server == a.url and len(out.output_ids) == 3
        assert "(restart 1)" in open(a.log_path).read()


async def _one(url):
    async with RolloutClient([url]) as c:
        return (await c.generate([1, 2, 3], {"max_new_tokens": 3, "ignore_eos": True}))[0]


def test_all_servers_gone_fails_clearly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def go():
        async with RolloutClient([f"http://127.0.0.1:{port}"], max_retries=1, retry_backoff_s=0.01,
                                 wait_for_server_s=1.0) as c:
            with pytest.raises(Exception, match="no healthy rollout server|failed"):
                await c.generate([1, 2], {"max_new_tokens": 2})
            return c.stats

    stats = asyncio.run(go())
    assert stats.failed == 1


def test_preflight_errors_before_start(tiny_model_dir, tmp_path):
    with pytest.raises(ServerStartError, match="no config.json"):
        preflight(ServerSpec(model_path=str(tmp_path / "nope"), engine="local"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServerStartError, match=f"port {port}"):
            preflight(ServerSpec(model_path=tiny_model_dir, engine="local", port=port))
    with pytest.raises(ValueError, match="quantization"):
        preflight(ServerSpec(model_path=tiny_model_dir, engine="local", quantization="fp8"))


def test_never_healthy_server_reports_its_log_tail(tmp_path):
    bad = tmp_path / "bad_model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "no_such_architecture_xyz"}')
    from m2po_megatron.rollout.launcher import ServerProcess

    proc = ServerProcess(ServerSpec(model_path=str(bad), engine="local"), str(tmp_path / "bad.log"),
                         max_restarts=0, health_timeout_s=120)
    with pytest.raises(ServerStartError) as e:
        proc.start()
    msg = str(e.value)
    assert "exited with code" in msg and "no_such_architecture_xyz" in msg
    assert not proc.alive()
    assert os.path.exists(tmp_path / "bad.log")
