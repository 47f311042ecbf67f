"""The rollout runner: what a plug-in returns or raises becomes Episodes (usable, or a problem naming the
field), counted per problem; a first step of failures stops the run; sample and batch building keep the
loss mask, the policy tokens' versions and the ledger identity."""
import asyncio
import math

import pytest
import torch

from m2po_megatron.agents.runner import (PROBLEMS, Episode, RolloutFunctionFailed, RolloutRunner, check_result,
                                         normalised)
from m2po_megatron.api import RolloutResult, Trajectory, Generation
from m2po_megatron.rollout.groups import sample_of
from m2po_megatron.rollout.samples import Group, build_step_batch
from m2po_megatron.staleness import SampleLedger

pytestmark = pytest.mark.timeout(60)
N = 3


def res(ids=(5, 6, 7, 8), mask=(1, 1, 0, 1), lps=None, vs=None, **kw) -> RolloutResult:
    ids = list(ids)
    return RolloutResult(ids, list(mask), list(lps if lps is not None else [-0.5] * len(ids)),
                         list(vs if vs is not None else [2] * len(ids)), **kw)


@pytest.mark.parametrize("bad,problem,field", [
    (dict(mask=(1, 1, 0)), "bad_mask", "loss_mask has 3 entries for 4"),
    (dict(mask=(1, 2, 0, 1)), "bad_mask", "0 or 1"),
    (dict(mask=(0, 0, 0, 0)), "empty", "no 1"),
    (dict(ids=(), mask=()), "empty", "token_ids is empty"),
    (dict(lps=[-0.5, float("nan"), 0.0, -1.0]), "missing_logprobs", "logprobs[1]"),
    (dict(lps=[-0.5, -0.5]), "missing_logprobs", "logprobs has 2 entries"),
    (dict(vs=[2, None, 2, 2]), "missing_versions", "versions[1]"),
    (dict(vs=[2, 2, 2]), "missing_versions", "versions has 3 entries"),
    (dict(ids=(5, 6, 7, 999)), "bad_tokens", "outside [0, 100)"),
    (dict(ids=("a", 6, 7, 8)), "bad_tokens", "list of ints"),
    (dict(reward=float("inf")), "bad_result", "reward"),
    (dict(metadata={"x": object()}), "bad_result", "JSON"),
    (dict(finish_reason="done"), "bad_result", "finish_reason"),
])
def test_each_malformation_is_named(bad, problem, field):
    got, detail = check_result(res(**bad), vocab_size=100, max_tokens=64, prompt_len=4)
    assert got == problem and field in detail and got in PROBLEMS, (got, detail)


def test_a_good_result_passes_and_environment_values_are_never_read():
    r = res(lps=[-0.5, -0.25, None, -1.0], vs=[2, 3, None, 3])  # the env token's entries may be anything
    assert check_result(r, vocab_size=100, max_tokens=64, prompt_len=4) == (None, "")
    n = normalised(r)
    assert n.logprobs == [-0.5, -0.25, 0.0, -1.0] and n.versions == [2, 3, -1, 3]
    assert check_result(res(), vocab_size=100, max_tokens=7, prompt_len=4)[0] == "too_long"
    # an aborted result is dropped as `aborted` later, whatever else it holds
    assert check_result(res(ids=(), mask=(), finish_reason="abort"), vocab_size=100, max_tokens=64,
                        prompt_len=4) == (None, "")


def runner(fn, **kw) -> RolloutRunner:
    return RolloutRunner(fn, "test:fn", tokenizer=None, sampling={}, n=N, timeout_s=kw.pop("timeout_s", 5.0),
                         score=lambda text, answer: 0.0, vocab_size=100, max_tokens=64, **kw)


def run_group(r: RolloutRunner, gid="g0"):
    return asyncio.run(r.run_group(None, {"id": "r0", "answer": "1"}, [1, 2, 3], seed=7, group_id=gid))


def test_raise_timeout_and_wrong_count_drop_the_whole_group_with_their_reason():
    async def raises(ctx):
        raise KeyError("tool")

    async def sleeps(ctx):
        try:
            await asyncio.sleep(60)
        finally:
            ctx.log(cancelled=1)

    async def short(ctx):
        return [res()] * (ctx.n - 1)

    for fn, problem, text in ((raises, "error", "KeyError"), (sleeps, "timeout", "function_timeout_s"),
                              (short, "bad_result", f"expected a list of ctx.n = {N}")):
        r = runner(fn, timeout_s=0.2)
        eps = run_group(r)
        assert [e.problem for e in eps] == [problem] * N and text in eps[0].detail
        assert r.stats()[f"rollout_fn/dropped/{problem}"] == N
        assert r.stats() == {}  # read once


def test_per_sample_problems_rejections_and_custom_metrics():
    async def fn(ctx):
        ctx.log(turns=ctx.n)
        ctx.log(turns=1)
        return [res(), res(mask=(1,)), res(vs=[1, 1, -1, 0]), None][:ctx.n]

    r = runner(fn)
    eps = run_group(r)
    assert [e.problem for e in eps] == [None, "bad_mask", None]
    eps = asyncio.run(r.run_group(None, {"answer": "1"}, [1, 2, 3], seed=7, group_id="g1", n=4))
    assert [e.problem for e in eps] == [None, "bad_mask", None, "rejected"]  # None: the function's own drop
    r.stats()
    run_group(r)
    st = r.stats()
    assert st["rollout_fn/dropped/bad_mask"] == 1 and st["rollout/custom/turns"] == (N + 1) / 2
    assert math.isclose(st["rollout_fn/env_token_frac"], 2 / 8)
    with pytest.raises(ValueError, match="finite"):
        asyncio.run(fn_logging_nan(r))


async def fn_logging_nan(r):
    ctx, _, log = r.context(None, {"answer": "1"}, [1], 0, "g", N)
    ctx.log(x=float("nan"))


def test_a_first_step_of_failures_stops_with_the_reasons_and_one_success_prevents_it():
    async def raises(ctx):
        raise RuntimeError("no sandbox")

    r = runner(raises, fail_limit=2 * N)
    run_group(r, "g0")
    with pytest.raises(RolloutFunctionFailed, match="every episode of the first step failed.*no sandbox"):
        run_group(r, "g1")

    calls = {"n": 0}

    async def first_ok(ctx):
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("later")
        return [res()] * ctx.n

    r = runner(first_ok, fail_limit=N)
    for g in range(4):
        run_group(r, f"g{g}")  # failures after a success are dropped, never fatal


def test_masked_samples_reach_the_batch_with_their_mask_and_policy_versions():
    ledger = SampleLedger()
    g = Group("g0", "p0", [1, 2], "3")
    traj = Trajectory([1, 2])
    traj.add_generation(Generation([5, 6], [-0.1, -0.2], [3, 4], "stop"))
    traj.add_environment([9, 9])
    traj.add_generation(Generation([7], [-0.3], [5], "stop"))
    eps = [Episode(normalised(traj.result())), Episode(normalised(res(mask=(1, 1, 1, 1), vs=[5, 5, 5, 5]))),
           Episode(None, "error", "boom")]
    g.samples = [sample_of(e, f"g0/{i}", g) for i, e in enumerate(eps)]
    ledger.add(g.sample_ids)
    for s, r in zip(g.samples, (1.0, 0.0, None)):
        s.reward = r
    s0 = g.samples[0]
    assert s0.output_ids == [5, 6, 9, 9, 7] and s0.loss_mask == [1, 1, 0, 0, 1] and s0.min_version == 3
    assert g.samples[1].loss_mask is None  # all the policy's: stored as the built-in's samples are
    sb = build_step_batch([g], version=6, ledger=ledger, max_staleness=4)
    b = sb.batch
    assert [m.tolist() for m in b.loss_mask] == [[True, True, False, False, True], [True] * 4]
    assert b.behav_log_probs[0].tolist() == pytest.approx([-0.1, -0.2, 0.0, 0.0, -0.3])
    acc = ledger.end_step(pending=0)
    assert acc["samples/dropped/bad_rollout"] == 1 and acc["samples/consumed"] == 2
    assert acc["staleness/max"] == 3  # 6 - the oldest policy token's version (the env's -1 is no version)
    assert sb.metrics["batch/policy_tokens"] == 3 + 4


def test_versions_ahead_of_the_trainer_are_dropped_not_fatal():
    ledger = SampleLedger()
    g = Group("g0", "p0", [1, 2], "3")
    g.samples = [sample_of(Episode(normalised(res(mask=(1, 1, 1, 1), vs=v))), f"g0/{i}", g)
                 for i, v in enumerate(([1, 1, 1, 1], [1, 1, 1, 99]))]
    ledger.add(g.sample_ids)
    for s in g.samples:
        s.reward = 1.0
    sb = build_step_batch([g], version=2, ledger=ledger)
    assert len(sb.batch) == 1 and sb.metrics["rollout_fn/dropped/future_versions"] == 1
    assert ledger.end_step(pending=0)["samples/dropped/bad_rollout"] == 1
    assert torch.equal(sb.batch.input_ids[0], torch.tensor([1, 2, 5, 6, 7, 8]))


def test_buffered_masked_samples_survive_a_checkpoint_as_json():
    import json

    from m2po_megatron.rollout.groups import group_from_dict, group_to_dict

    g = Group("g0", "p0", [1, 2], "3")
    traj = Trajectory([1, 2]).add_generation(Generation([5], [-0.1], [3], "stop")).add_environment([9])
    traj.add_generation(Generation([7], [-0.3], [4], "stop"))
    g.samples = [sample_of(Episode(normalised(traj.result(metadata={"tool": "calc"}))), "g0/0", g),
                 sample_of(Episode(None, "timeout", "slow"), "g0/1", g)]
    back = group_from_dict(json.loads(json.dumps(group_to_dict(g))))
    assert [s.__dict__ for s in back.samples] == [s.__dict__ for s in g.samples]
    assert back.samples[0].loss_mask == [1, 0, 1] and back.samples[1].rollout_problem == "timeout"


def test_a_group_level_drop_is_printed_once_and_later_ones_only_counted(capsys):
    async def raises(ctx):
        raise KeyError("tool")

    r = runner(raises)
    for g in range(5):
        run_group(r, f"g{g}")
    lines = [x for x in capsys.readouterr().out.splitlines() if "dropped (error)" in x]
    assert len(lines) == 3 and "later ones only counted" in lines[-1]  # one per group, then silence
    assert r.stats()["rollout_fn/dropped/error"] == 5 * N


def test_the_servers_failure_is_not_the_plugins_and_stops_the_run():
    """RolloutFailed (no server within the client's retries) passes through the runner, as it stopped the run
    before plug-ins existed; a plug-in's own exception is a counted drop."""
    from m2po_megatron.rollout.client import RolloutFailed

    async def servers_gone(ctx):
        raise RolloutFailed("no healthy rollout server within 300 s")

    r = runner(servers_gone)
    with pytest.raises(RolloutFailed):
        run_group(r)
    assert r.stats() == {}
