"""plan/bound.py: the upper bound the search prunes by holds against the simulation, in every mode and seed, and
is close enough to prune."""
import random

import pytest

from m2po_megatron.plan.bound import margin, moments, upper_bound
from m2po_megatron.plan.costs import Costs
from m2po_megatron.plan.runs import run_one, summarize
from m2po_megatron.plan.sim import LengthDist, SimSpec

MEASURED = 6


def _simulate(sp, c, measured, seed):
    return summarize(sp, run_one(sp, c, measured, seed))


def _random_case(rng: random.Random) -> tuple[SimSpec, Costs]:
    mode = rng.choice(["on_policy", "fixed_lag", "bounded"])
    U = rng.choice([1, 2, 4])
    top = rng.choice([16, 48, 128])
    sp = SimSpec(mode=mode, groups_per_step=rng.choice([4, 8, 16]), n=rng.choice([2, 4, 8]), updates_per_step=U,
                 prompt_len=rng.choice([8, 64, 256]), response=LengthDist(top / rng.choice([1.5, 3, 6]),
                                                                          rng.choice([0.0, 0.3, 0.6, 1.0]), top),
                 num_servers=rng.choice([1, 2, 3]), max_staleness=U * rng.choice([1, 2, 4]) if mode == "bounded"
                 else 0, sync_interval=U * rng.choice([1, 2]) if mode == "bounded" else None,
                 lag_steps=2 if mode == "fixed_lag" else 0, logprob_pass=rng.random() < 0.5,
                 recompute_behaviour=mode != "bounded" and rng.random() < 0.5)
    if sp.mode == "bounded" and sp.sync_interval > sp.max_staleness:
        sp = SimSpec(**{**sp.__dict__, "sync_interval": U})
    scale = rng.choice([0.1, 1.0, 10.0])  # trainer-bound, balanced, generation-bound
    c = Costs(train_fixed_s=0.05, train_per_update_s=0.01, train_per_token_s=2e-5 / scale,
              logprob_per_token_s=7e-6 / scale, decode_fixed_s=rng.choice([1e-3, 1e-2]),
              decode_per_seq_s=rng.choice([1e-5, 1e-4]), decode_per_kv_s=rng.choice([1e-8, 1e-7]),
              prefill_per_token_s=rng.choice([1e-6, 1e-5]), max_running=rng.choice([4, 32, 256]),
              sync_fixed_s=0.05, sync_per_byte_s=1e-9, weight_bytes=1e6, loop_fixed_s=rng.choice([0.0, 0.01]),
              decode_weights_s=rng.choice([0.0, 5e-3]), decode_roofline=rng.random() < 0.5)
    return sp, c


@pytest.mark.parametrize("case", range(40))
def test_no_simulation_beats_the_bound(case):
    sp, c = _random_case(random.Random(case))
    bound = upper_bound(sp, c, MEASURED)
    runs = [_simulate(sp, c, MEASURED, seed)["tokens_per_s"] for seed in range(3)]
    # each seed alone (the margin is for a mean over seeds, so this is the stricter check)
    assert max(runs) <= bound * (1 + margin(sp, MEASURED, 1)), (sp, c, runs, bound)
    # and the bound is tight enough to prune: the simulation reaches a fair share of it
    assert sum(runs) / len(runs) >= 0.3 * bound, (sp, c, runs, bound)


def test_the_bound_of_a_synchronous_step_includes_its_longest_response():
    # one server, room for all: the step waits for the longest response, not for the mean work
    c = Costs(train_fixed_s=0.0, train_per_update_s=0.0, train_per_token_s=0.0, logprob_per_token_s=0.0,
              decode_fixed_s=0.01, decode_per_seq_s=0.0, decode_per_kv_s=0.0, prefill_per_token_s=0.0,
              max_running=1024, sync_fixed_s=0.0, sync_per_byte_s=0.0, weight_bytes=0.0)
    sp = SimSpec(mode="on_policy", groups_per_step=16, n=8, updates_per_step=1, prompt_len=10,
                 response=LengthDist(100, 0.0, 100))
    assert moments(sp.response, 128).longest == 100
    assert upper_bound(sp, c) == pytest.approx(128 * 110 / (100 * 0.01))
    sim = _simulate(sp, c, 4, 0)["tokens_per_s"]
    assert sim == pytest.approx(upper_bound(sp, c), rel=1e-6)  # exact when every response has the same length
