"""A prompt's n samples travel as one SGLang batch request and join the CPU engine's batch at the same step;
the client's concurrency bound counts samples."""
import asyncio
import json

import pytest

from m2po_megatron.rollout import _http, protocol
from m2po_megatron.rollout.client import RolloutClient, _Slots, build_batch_body, build_generate_body
from tests.rollout.conftest import local_server

pytestmark = pytest.mark.timeout(240)


def _engine_steps(url):
    return json.loads(_http.request(f"{url}/get_server_info")[1])["internal_states"][0]["steps"]


def test_group_samples_arrive_together_and_take_max_new_tokens_steps(tiny_model_dir, tmp_path):
    """With ignore_eos every sample has exactly T tokens; if all n samples enter the batch at one step the
    engine runs exactly T steps (one prefill, T-1 decodes). A sample admitted a step later would add one."""
    T, n = 6, 8
    with local_server(tiny_model_dir, tmp_path) as srv:
        async def go():
            async with RolloutClient([srv.url]) as c:
                before = await asyncio.to_thread(_engine_steps, srv.url)
                out = await c.generate([5, 6, 7, 8], {"max_new_tokens": T, "ignore_eos": True,
                                                      "sampling_seed": 11}, n=n)
                after = await asyncio.to_thread(_engine_steps, srv.url)
                return out, after - before, c.stats

        out, steps, stats = asyncio.run(go())
    assert [len(o.output_ids) for o in out] == [T] * n
    assert steps == T
    assert len({tuple(o.output_ids) for o in out}) > 1  # seed + i: the samples differ
    assert stats.requests == stats.completed == n and stats.per_server[srv.url]["completed"] == n


def test_batch_body_is_one_sglang_batch_of_the_single_bodies():
    seeds = [3, 4, 5]
    body = build_batch_body([1, 2, 3], {"temperature": 0.7, "max_new_tokens": 4}, seeds)
    protocol.validate_request("POST /generate", body)
    assert body["input_ids"] == [[1, 2, 3]] * 3 and len(set(body["rid"])) == 3
    assert [sp["sampling_seed"] for sp in body["sampling_params"]] == seeds
    single = build_generate_body([1, 2, 3], {"temperature": 0.7, "max_new_tokens": 4, "sampling_seed": 3}, "r")
    assert body["sampling_params"][0] == single["sampling_params"]
    with pytest.raises(protocol.ProtocolError):  # the same early refusal as a single body
        build_batch_body([1, 2], {"min_new_tokens": 1}, [0, 1])


def test_slots_bound_samples_and_release_on_cancel():
    async def go():
        slots, peak, held = _Slots(10), [0], []

        async def job(k, hold):
            got = await slots.acquire(k)
            held.append(got)
            peak[0] = max(peak[0], slots.limit - slots.free)
            await hold.wait()
            slots.release(got)

        release = asyncio.Event()
        tasks = [asyncio.create_task(job(8, release)) for _ in range(3)]
        big = asyncio.create_task(job(25, release))  # larger than the limit: waits for all 10
        for _ in range(5):
            await asyncio.sleep(0)
        assert held == [8] and slots.free == 2
        tasks[1].cancel()  # a waiter cancelled before it got slots takes none
        for _ in range(5):
            await asyncio.sleep(0)
        release.set()
        await asyncio.gather(tasks[0], tasks[2], big, return_exceptions=True)
        return slots, peak[0], held

    slots, peak, held = asyncio.run(go())
    assert slots.free == slots.limit == 10 and peak <= 10
    assert sorted(held) == [8, 8, 10]
