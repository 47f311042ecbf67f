"""The local engine launched through a Ray actor: healthy, serves, restarted after a crash, within budget; a dead
actor replaced while nobody asks."""
import asyncio
import os
import shutil
import signal
import tempfile
import time

import pytest

from m2po_megatron.rollout.client import RolloutClient
from m2po_megatron.rollout.launcher import EngineManager, ServerSpec

pytestmark = pytest.mark.timeout(280)


@pytest.fixture
def ray_local():
    ray = pytest.importorskip("ray")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    tmp = tempfile.mkdtemp(prefix="/tmp/m2por")  # short: Ray's socket paths have a length limit
    ray.init(address="local", num_cpus=2, object_store_memory=80 * 1024 * 1024, include_dashboard=False,
             _temp_dir=tmp, log_to_driver=False, runtime_env={"env_vars": {"M2PO_CPU_SERVER_THREADS": "1"}})
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


async def _one(url, with_stats=False):
    async with RolloutClient([url], retry_backoff_s=0.1, wait_for_server_s=200) as c:
        out = (await c.generate([3, 4, 5], {"max_new_tokens": 4, "ignore_eos": True}))[0]
        return (out, c.stats) if with_stats else out


def _wait(pred, what, timeout=180):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.5)


def test_ray_actor_serves_and_restarts_within_budget(ray_local, tiny_model_dir, tmp_path):
    mgr = EngineManager([ServerSpec(model_path=tiny_model_dir, engine="local")], run_dir=str(tmp_path),
                        use_ray=True, max_restarts=1, health_timeout_s=180)
    try:
        (url,) = mgr.start()
        assert url.startswith("http://127.0.0.1:")
        assert len(asyncio.run(_one(url)).output_ids) == 4
        log = tmp_path / "rollout" / "server_0.log"
        assert log.exists() and "fired up" in log.read_text()

        mgr.kill_server(0)
        # a request sent right after the crash is served by the restarted server: the launcher keeps the
        # port bound, so the connection waits for it (or, cut by the crash, is re-issued), never fails
        out, stats = asyncio.run(_one(url, with_stats=True))
        assert len(out.output_ids) == 4 and stats.failed == 0
        info = mgr.info()[0]
        assert info["restarts"] == 1 and info["alive"] and info["last_error"] is None

        mgr.kill_server(0)  # the budget (1 restart) is spent: it stays down and says why
        _wait(lambda: "budget" in (mgr.info()[0]["last_error"] or ""), "restart budget not reported", 60)
        assert not mgr.info()[0]["alive"] and mgr.info()[0]["restarts"] == 1
    finally:
        mgr.shutdown()


def test_a_dead_actor_is_replaced_while_nobody_asks(ray_local, tiny_model_dir, tmp_path):
    """The loop may be blocked waiting for the very server whose actor died, so the manager must notice by
    itself: a request sent after the kill is answered though nothing here calls info()."""
    mgr = EngineManager([ServerSpec(model_path=tiny_model_dir, engine="local")], run_dir=str(tmp_path),
                        use_ray=True, max_restarts=1, health_timeout_s=180)
    try:
        (url,) = mgr.start()
        before = mgr.info()[0]
        os.kill(before["actor_pid"], signal.SIGKILL)
        out, stats = asyncio.run(_one(url, with_stats=True))  # waits for a server on the URL (up to 200 s)
        assert len(out.output_ids) == 4 and stats.failed == 0
        after = mgr.info()[0]
        assert after["restarts"] == 1 and after["alive"] and after["actor_pid"] != before["actor_pid"]
    finally:
        mgr.shutdown()
