"""A server killed with requests in flight: they are re-issued on the other server, answered there and counted;
the killed server is restarted (bounded) and serves again. Start errors are clear and come before anything starts."""
import asyncio
import json
import os
import socket
import time

import pytest

from m2po_megatron.rollout import _http
from m2po_megatron.rollout.client import RolloutClient
from m2po_megatron.rollout.launcher import ServerSpec, ServerStartError, preflight, wait_healthy
from tests.rollout.conftest import local_server

pytestmark = pytest.mark.timeout(280)


def test_killed_server_requests_are_reissued_and_server_restarts(tiny_model_dir, tmp_path):
    """Server a holds its requests (paused), so none can finish there before it dies: every one of them must
    be re-issued and answered by b, and the counters say so request by request."""
    with local_server(tiny_model_dir, tmp_path, max_restarts=1) as a, local_server(tiny_model_dir, tmp_path) as b:
        _http.post_ok(f"{a.url}/pause_generation", {"mode": "in_place"})

        async def scenario():
            async with RolloutClient([a.url, b.url], max_retries=3, retry_backoff_s=0.1) as client:
                sp = {"max_new_tokens": 8, "ignore_eos": True}
                tasks = [asyncio.create_task(client.generate([5 + i, 6, 7], sp, n=1)) for i in range(6)]

                def dispatched():  # per_server is a fresh snapshot after each change
                    ps = client.stats.per_server
                    return ps and ps[a.url]["outstanding"] + ps[b.url]["outstanding"] + ps[b.url]["completed"]

                while dispatched() != 6:
                    await asyncio.sleep(0.01)  # until every request went to a server
                on_a = client.stats.per_server[a.url]["outstanding"]  # constant now: a answers nothing while paused
                await asyncio.to_thread(_wait_held, a.url, on_a)  # all of them arrived at a
                a.kill()
                results = await asyncio.gather(*tasks)
                return results, client.stats, on_a

        results, stats, on_a = asyncio.run(scenario())
        assert [r[0].server for r in results] == [b.url] * 6  # a answered nothing
        assert all(len(r[0].output_ids) == 8 for r in results)
        assert stats.reissued == on_a == stats.per_server[a.url]["errors"] and on_a >= 1
        assert stats.per_server[a.url]["completed"] == 0 and stats.per_server[b.url]["completed"] == 6
        assert stats.failed == 0 and stats.completed == 6
        # the watchdog restarts the killed server once (max_restarts=1) and it serves again
        deadline = time.monotonic() + 180
        while not (a.restarts == 1 and a.alive() and a.last_error is None):
            assert time.monotonic() < deadline, a.info()
            time.sleep(0.5)
        wait_healthy(a.url, timeout_s=120)
        out = asyncio.run(_one(a.url))
        assert out.server == a.url and len(out.output_ids) == 3
        assert "(restart 1)" in open(a.log_path).read()


def _wait_held(url, n, timeout=120):
    """Until the paused server at url holds n requests (its get_server_info says so); polled with a deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = json.loads(_http.request(f"{url}/get_server_info")[1])["internal_states"][0]["held_by_pause"]
        if held == n:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{url} holds {held} requests, not {n}, after {timeout} s")


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
