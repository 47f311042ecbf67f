"""Against the real CPU rollout server (SGLang's protocol): a multi-turn sample's ids are exactly the engine's
outputs and the environment's additions, concatenated (nothing re-tokenized), with the mask 1 exactly on
the engine's tokens, the episode's turns on one server, and pause modes between and within turns."""
import asyncio
import importlib.util
from pathlib import Path

import pytest

from m2po_megatron.agents.runner import RolloutRunner
from m2po_megatron.rollout.client import RolloutClient
from tests.rollout.conftest import local_server, make_tiny_qwen2

pytestmark = pytest.mark.timeout(300)
N = 3


def plugin(name: str):
    spec = importlib.util.spec_from_file_location("plugins_under_test", Path(__file__).parent / "plugins.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


class Tok:
    """The plug-in tokenizes its hint with ctx.tokenizer: a fixed hint, as the test's tokenizer."""
    HINT = [11, 12, 13]

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": list(self.HINT)}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tiny_model_dir = make_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))
    logs = tmp_path_factory.mktemp("logs")
    with local_server(tiny_model_dir, logs, random_seed=0, enable_deterministic_inference=True) as a, \
            local_server(tiny_model_dir, logs, random_seed=0, enable_deterministic_inference=True) as b:
        yield [a.url, b.url]


def test_ids_are_the_engines_outputs_and_the_environments_additions(servers):
    prompt, seed = [3, 4, 5, 6], 1234
    sampling = {"temperature": 1.0, "max_new_tokens": 10}
    runner = RolloutRunner(plugin("two_turns"), "two_turns", tokenizer=Tok(), sampling=sampling, n=N, timeout_s=120,
                           score=lambda t, a: 0.0, vocab_size=384, max_tokens=512, args={"first_tokens": 5})

    async def go():
        client = RolloutClient(servers)
        try:
            eps = await runner.run_group(client, {"id": "r", "answer": "1"}, prompt, seed, "g0")
            replay = []
            for i in range(N):  # the same requests again, by hand: the server is deterministic given the seed
                (g1,) = await client.generate(prompt, dict(sampling, max_new_tokens=5, sampling_seed=seed + i))
                ctx2 = prompt + g1.output_ids + Tok.HINT
                (g2,) = await client.generate(ctx2, dict(sampling, sampling_seed=seed + i + N))
                replay.append((g1, g2))
            return eps, replay
        finally:
            await client.close()

    eps, replay = asyncio.run(go())
    stats = runner.stats()
    assert stats["rollout/custom/same_server"] == 1.0 and stats["rollout/custom/turns"] == 2.0
    for ep, (g1, g2) in zip(eps, replay):
        r = ep.result
        assert ep.problem is None and r is not None
        assert r.token_ids == g1.output_ids + Tok.HINT + g2.output_ids
        assert r.loss_mask == [1] * len(g1.output_ids) + [0] * len(Tok.HINT) + [1] * len(g2.output_ids)
        assert r.logprobs == pytest.approx(g1.output_logprobs + [0.0] * 3 + g2.output_logprobs)
        assert r.versions == g1.token_versions + [-1] * 3 + g2.token_versions


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_pause_modes_between_and_within_turns(servers, mode):
    """A pause lands while episodes are in their turns; after continue_generation every episode ends: whole
    (retract, in_place) or aborted (abort: dropped as `aborted` later), never hung or malformed."""
    # long turns (hundreds of decode steps), so the pause lands inside turns; the assertions below hold
    # wherever it lands
    sampling = {"temperature": 1.0, "max_new_tokens": 300, "ignore_eos": True}
    runner = RolloutRunner(plugin("two_turns"), "two_turns", tokenizer=Tok(), sampling=sampling, n=N, timeout_s=120,
                           score=lambda t, a: 0.0, vocab_size=384, max_tokens=1024, args={"first_tokens": 200})

    async def go():
        client = RolloutClient(servers)
        try:
            tasks = [asyncio.ensure_future(runner.run_group(client, {"id": f"r{g}", "answer": "1"}, [3, 4, 5],
                                                            100 * g, f"g{g}")) for g in range(4)]
            while not any(s["outstanding"] for s in client.stats.per_server.values()):
                await asyncio.sleep(0.01)  # the first turns are running
            await client.pause(mode)  # within the first turns (and, for some, between them)
            await asyncio.sleep(0.5)
            await client.continue_generation()
            return await asyncio.wait_for(asyncio.gather(*tasks), 240)
        finally:
            await client.close()

    groups = asyncio.run(go())
    for eps in groups:
        for ep in eps:
            assert ep.problem is None, ep.detail
            r = ep.result
            if mode != "abort":
                assert r.finish_reason != "abort" and r.loss_mask.count(0) == len(Tok.HINT)
            assert len(r.token_ids) == len(r.loss_mask) == len(r.versions)
