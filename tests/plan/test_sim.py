"""plan/sim.py: the simulated servers against closed forms, and the project's own controller driving it."""
import dataclasses

import pytest

from m2po_megatron.plan.costs import Costs
from m2po_megatron.plan.sim import LengthDist, SimSpec, simulate
from m2po_megatron.staleness import StalenessController

COSTS = Costs(train_fixed_s=0.2, train_per_update_s=0.05, train_per_token_s=2e-5, logprob_per_token_s=7e-6,
              decode_fixed_s=0.01, decode_per_seq_s=1e-4, decode_per_kv_s=1e-7, prefill_per_token_s=1e-5,
              max_running=256, sync_fixed_s=0.1, sync_per_byte_s=1e-9, weight_bytes=1e6)
# from_hardware's form: a decode step is fixed + max(compute, weights + KV); 128 sequences of 40 prompt tokens
# start compute-bound (12.8 ms against 12.7) and turn memory-bound 7 steps in, as their KV grows
ROOF = dataclasses.replace(COSTS, decode_fixed_s=0.002, decode_weights_s=0.0122, decode_roofline=True)


def spec(**kw):
    base = dict(mode="on_policy", groups_per_step=16, n=8, updates_per_step=2, prompt_len=40,
                response=LengthDist(20, 0.5, 24))
    return SimSpec(**{**base, **kw})


@pytest.mark.parametrize("costs", [COSTS, ROOF], ids=["sum", "roofline"])
def test_decode_steps_invert_the_series(costs):
    for b, kv in ((1, 0), (3, 24), (128, 5000), (128, 0), (1000, 0)):
        for k in (0, 1, 7, 500):
            t = costs.decode_s(k, b, kv)
            assert costs.steps_within(t, b, kv) == k  # exactly at the boundary, despite round-off
            if k:
                assert costs.steps_within(t * (1 - 1e-6), b, kv) == k - 1


@pytest.mark.parametrize("costs", [COSTS, ROOF], ids=["sum", "roofline"])
def test_on_policy_step_is_generation_plus_training_plus_sync_in_closed_form(costs):
    # every sample the same length, one server holding all of them: one prefill, then L decode steps of B
    L, P, G, n, U = 20, 40, 16, 8, 2
    r = simulate(spec(response=LengthDist(L, 0.0, 24), prompt_len=P, groups_per_step=G, n=n), costs, steps=3)
    B = G * n
    gen = B * P * costs.prefill_per_token_s + sum(costs.decode_step_s(B, B * (P + i)) for i in range(L))
    train = costs.train_s(B * (P + L), U, False)
    for row in r.steps:
        assert row["wait_s"] == pytest.approx(gen, rel=1e-9)
        assert row["train_s"] == pytest.approx(train, rel=1e-9)
        assert row["sync_s"] == pytest.approx(costs.sync_s(), rel=1e-9)
        assert row["staleness_max"] == 0 and row["tokens"] == B * (P + L)


def test_max_running_queues_the_rest():
    L, P = 10, 4
    costs = Costs(**{**COSTS.__dict__, "max_running": 64})
    r = simulate(spec(response=LengthDist(L, 0.0, 24), prompt_len=P, groups_per_step=16, n=8), costs, steps=1)
    one = 64 * P * costs.prefill_per_token_s + costs.decode_s(L, 64, 64 * P)
    assert r.steps[0]["wait_s"] == pytest.approx(2 * one, rel=1e-9)  # two waves of 64


def test_fixed_lag_staleness_is_the_lag():
    r = simulate(spec(mode="fixed_lag", lag_steps=3), COSTS, steps=8)
    assert [row["staleness_max"] for row in r.steps[3:]] == [6] * 5  # lag 3 x 2 updates, once warm


@pytest.mark.parametrize("eta,sync", [(4, 2), (8, 4), (2, 2)])
def test_bounded_keeps_the_bound_and_overlaps(eta, sync):
    on = simulate(spec(), COSTS, steps=12).summary()
    r = simulate(spec(mode="bounded", max_staleness=eta, sync_interval=sync), COSTS, steps=12)
    s = r.summary()
    assert all(row["staleness_max"] <= eta for row in r.steps)
    assert s["step_s"] < 0.75 * on["step_s"]  # generation hides behind training
    assert s["staleness_mean"] > 0


def test_a_window_below_updates_per_step_cannot_overlap():
    on = simulate(spec(), COSTS, steps=10).summary()
    s = simulate(spec(mode="bounded", max_staleness=1, sync_interval=1), COSTS, steps=10).summary()
    assert s["staleness_max"] == 0 and s["step_s"] == pytest.approx(on["step_s"], rel=0.05)


class OneStepAhead(StalenessController):
    """A stricter admission rule: never more than one step's groups unconsumed."""

    def capacity(self) -> int:
        return max(0, min(super().capacity(), self.groups_per_step - self.unconsumed))


def test_the_simulation_runs_the_controller_it_is_given():
    sp = spec(mode="bounded", max_staleness=8, sync_interval=2)
    real = simulate(sp, COSTS, steps=12).summary()
    strict = simulate(sp, COSTS, steps=12, controller_factory=OneStepAhead).summary()
    assert strict["step_s"] > 1.3 * real["step_s"] and strict["staleness_mean"] < real["staleness_mean"]


def test_dynamic_sampling_regenerates_through_the_real_filter():
    # n = 2 at accuracy 0.5: half the groups have equal rewards and are dropped, then replaced
    plain = simulate(spec(n=2), COSTS, steps=6, seed=1).summary()
    filt = simulate(spec(n=2, max_gen_batches=4), COSTS, steps=6, seed=1)
    assert filt.summary()["wait_s"] > 1.5 * plain["wait_s"]
    assert all(row["samples"] <= 16 * 2 for row in filt.steps)


def test_bad_mode_names_the_field():
    with pytest.raises(ValueError, match="staleness.mode"):
        simulate(spec(mode="async"), COSTS, steps=1)


def test_length_distribution():
    import random
    rng = random.Random(0)
    d = LengthDist(100, 0.5, 150)
    xs = [d.sample(rng) for _ in range(4000)]
    assert max(xs) == 150 and min(xs) >= 1
    assert 85 < sum(xs) / len(xs) < 100  # the cut at 150 pulls the mean below 100
    assert LengthDist(7.4, 0.0, 10).sample(rng) == 7
