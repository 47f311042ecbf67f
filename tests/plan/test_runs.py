"""plan/runs.py: a synchronous layout's simulation is its shared generation retimed with its trainer's figures,
the same as simulating it; the sim's idle shares are what the table says they are."""
import dataclasses

import pytest

from m2po_megatron.plan.costs import Costs
from m2po_megatron.plan.runs import generation_key, retime, run_one, simulate_all, summarize
from m2po_megatron.plan.sim import LengthDist, SimSpec

COSTS = Costs(train_fixed_s=0.2, train_per_update_s=0.05, train_per_token_s=2e-5, logprob_per_token_s=7e-6,
              decode_fixed_s=0.01, decode_per_seq_s=1e-4, decode_per_kv_s=1e-7, prefill_per_token_s=1e-5,
              max_running=48, sync_fixed_s=0.1, sync_per_byte_s=1e-9, weight_bytes=1e6, loop_fixed_s=0.03)
# another trainer layout: three times slower per token, another fixed part and log-prob pass
SLOW = dataclasses.replace(COSTS, train_per_token_s=6e-5, train_fixed_s=0.5, logprob_per_token_s=3e-5,
                           loop_fixed_s=0.01, source="slow")


def spec(mode, **kw):
    base = dict(mode=mode, groups_per_step=8, n=4, updates_per_step=2, prompt_len=30,
                response=LengthDist(40, 0.6, 96), num_servers=2, lag_steps=3 if mode == "fixed_lag" else 0,
                logprob_pass=True, recompute_behaviour=mode != "bounded")
    if mode == "bounded":
        base.update(max_staleness=4, sync_interval=2)
    return SimSpec(**{**base, **kw})


@pytest.mark.parametrize("mode", ["on_policy", "fixed_lag"])
def test_a_retimed_generation_is_the_layouts_own_simulation(mode):
    sp = spec(mode, max_gen_batches=2)  # with the dynamic-sampling filter's extra rounds
    g_spec, g_costs = generation_key(sp, SLOW)
    assert generation_key(sp, COSTS) == (g_spec, g_costs)  # the two layouts share their generation
    shared = run_one(g_spec, g_costs, 4, seed=7)
    for c in (COSTS, SLOW):
        direct = summarize(sp, run_one(sp, c, 4, seed=7))
        derived = summarize(sp, retime(shared, sp, c))
        assert derived.keys() == direct.keys()
        for k, v in direct.items():
            assert derived[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    fast, slow = (summarize(sp, retime(shared, sp, c)) for c in (COSTS, SLOW))
    assert slow["trainer_idle_frac"] < fast["trainer_idle_frac"] and slow["tokens_per_s"] < fast["tokens_per_s"]


def test_bounded_and_shared_cores_are_simulated_each_on_its_own():
    sp = spec("bounded")
    assert generation_key(sp, COSTS) == (sp, COSTS)
    cpu = dataclasses.replace(COSTS, shared_cores=2, contention=0.3)  # the trainer slows the servers down
    assert generation_key(spec("on_policy"), cpu) == (spec("on_policy"), cpu)


def test_simulate_all_simulates_each_generation_once():
    sp = spec("on_policy")
    cache: dict = {}
    out = simulate_all([(sp, COSTS), (sp, SLOW)], 3, seed=0, seeds=2, cache=cache)
    assert len(cache) == 2  # one generation, two seeds
    assert [r["tokens_per_s"] for r in out[0]] != [r["tokens_per_s"] for r in out[1]]
    again = simulate_all([(sp, SLOW)], 3, seed=0, seeds=2, cache=cache)
    assert len(cache) == 2 and again[0] == out[1]


def test_idle_shares_are_of_the_measured_steps():
    """trainer idle: waiting for a batch, less the log-prob pass it makes itself; rollout idle: no sequence
    decoding, the mean over servers; both over the measured steps' wall time."""
    sp = spec("on_policy")
    res = run_one(sp, COSTS, 4, seed=1)
    s = res.summary()
    rows = res.steps[res.skip:]
    span = sum(r["step_s"] for r in rows)
    waiting = sum(r["wait_s"] - r["recompute_s"] for r in rows)
    assert all(r["recompute_s"] > 0 for r in rows)
    assert s["trainer_idle_frac"] == pytest.approx(waiting / span)
    # on-policy: the servers decode only while the trainer waits for them, so they are idle at least the
    # trainer's own share of the step, and busy no longer than the wait
    assert 1 - s["rollout_idle_frac"] <= waiting / span + 1e-9
    assert 0 < s["trainer_idle_frac"] < 1 and 0 < s["rollout_idle_frac"] < 1
