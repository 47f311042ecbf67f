"""FixedLagQueue reproduces the released M2PO loop: staleness min(j, k) x updates_per_step at step j."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m2po_megatron.staleness import FixedLagQueue


def _run(k: int, U: int, iterations: int, queue: FixedLagQueue | None = None, version: int = 0,
         first_iter: int = 0):
    """The released loop: generate with the current weights, enqueue, train on the popped batch if any."""
    q = queue if queue is not None else FixedLagQueue(k, U)
    trained = []  # (step version, batch generated at, payload)
    for it in range(first_iter, first_iter + iterations):
        batch = q.step({"prompts": f"batch-{it}"}, version)
        if batch is None:
            continue
        trained.append((version, batch.version, batch.payload["prompts"], batch.index))
        version += U  # the step applies U optimizer updates
    return q, trained, version


@settings(max_examples=60, deadline=None)
@given(k=st.integers(0, 9), U=st.integers(1, 5), extra=st.integers(0, 25))
def test_staleness_is_exactly_k_updates_after_warm_up(k, U, extra):
    q, trained, version = _run(k, U, k + extra)
    assert len(trained) == extra  # the first k iterations only generate
    for j, (v, gen_v, name, index) in enumerate(trained):
        assert v == j * U
        assert name == f"batch-{j}" and index == j  # FIFO
        assert v - gen_v == min(j, k) * U  # warm-up steps train base-model data (version 0)
        if j < k:
            assert gen_v == 0
        else:
            assert gen_v == (j - k) * U  # weights after step j - 1 - k
    assert len(q) == k


def test_on_policy_is_lag_zero():
    _, trained, _ = _run(0, 4, 6)
    assert [v - g for v, g, *_ in trained] == [0] * 6


def test_paper_setting_k64_is_staleness_256():
    _, trained, _ = _run(64, 4, 64 + 70)
    assert {v - g for v, g, *_ in trained[64:]} == {256}
    assert trained[63][0] - trained[63][1] == 252


@pytest.mark.parametrize("k", [0, 1, 3])
def test_state_round_trip_resumes_the_same_sequence(k, tmp_path):
    U = 2
    _, straight, _ = _run(k, U, 12)

    # stop after 7 iterations, save the queue with payloads written to files, resume in a new object
    q, first, version = _run(k, U, 7)

    def encode(p):
        path = tmp_path / f"{p['prompts']}.json"
        path.write_text(json.dumps(p))
        return str(path)

    state = json.loads(json.dumps(q.state_dict(encode)))
    q2 = FixedLagQueue(k, U)
    q2.load_state_dict(state, decode=lambda s: json.loads(open(s).read()))
    assert len(q2) == len(q)
    _, rest, _ = _run(k, U, 5, queue=q2, version=version, first_iter=7)
    assert first + rest == straight


def test_pushes_must_be_in_version_order():
    q = FixedLagQueue(2)
    q.push("a", 4)
    with pytest.raises(ValueError, match="older than the previous batch"):
        q.push("b", 3)
    with pytest.raises(ValueError, match="lag_steps = -1"):
        FixedLagQueue(-1)


def test_warming_up_flag():
    q = FixedLagQueue(2)
    assert q.warming_up
    assert q.step("a", 0) is None and q.warming_up
    assert q.step("b", 0) is None and not q.warming_up
    assert q.step("c", 0).payload == "a"
