"""StalenessController: admission control bounds staleness for every interleaving of generation,
training steps, weight syncs and drops (property tests), plus the closed forms and failure modes."""
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m2po_megatron.staleness import StalenessBoundError, StalenessController


def _roundtrip(ctl: StalenessController) -> StalenessController:
    fresh = StalenessController(ctl.max_staleness, ctl.groups_per_step, ctl.updates_per_step, ctl.sync_interval)
    fresh.load_state_dict(json.loads(json.dumps(ctl.state_dict())))
    assert fresh.state_dict() == ctl.state_dict()
    return fresh


@st.composite
def settings_(draw):
    U = draw(st.integers(1, 4))
    eta = draw(st.integers(0, 12))
    S = draw(st.integers(1, U * (eta // U + 1)))  # the largest sync interval the constructor accepts
    G = draw(st.integers(1, 4))
    return eta, G, U, S


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=settings_(), data=st.data())
def test_random_interleavings_never_exceed_the_bound(cfg, data):
    """Admission + select_batch alone (no drop of too-stale data) keep every consumed group within
    max_staleness. Groups finish at any version between their admission's server version and the
    current one: this covers one-version groups and partial rollouts whose oldest token is no older than
    the admission (a partial rollout resumed with tokens from before its admission is not covered; see
    test_tokens_older_than_admission_are_rejected)."""
    eta, G, U, S = cfg
    ctl = StalenessController(eta, G, U, S)
    admitted_at: dict[int, int] = {}  # independent bookkeeping: server version when admitted
    gen_version: dict[int, int] = {}
    next_id, steps, consumed = 0, 0, 0
    for _ in range(data.draw(st.integers(10, 80), label="events")):
        assert ctl.overdue() == []
        unconsumed = len(ctl.running()) + len(ctl.finished())
        if unconsumed < G:  # generation never starves the trainer
            assert ctl.capacity() >= G - unconsumed
        op = data.draw(st.sampled_from(["admit", "admit", "finish", "finish", "finish", "drop", "train",
                                        "train", "roundtrip", "early_sync"]))
        if op == "admit":
            want = data.draw(st.integers(0, 2 * G))
            ids = list(range(next_id, next_id + want))
            cap = ctl.capacity()
            n = ctl.try_admit(ids)
            assert n == min(want, cap)
            for g in ids[:n]:
                admitted_at[g] = ctl.server_version
            next_id += want  # refused ids are simply never used
        elif op == "finish" and ctl.running():
            g = data.draw(st.sampled_from(ctl.running()))
            v = data.draw(st.integers(admitted_at[g], ctl.server_version))
            ctl.on_generated(g, v)
            gen_version[g] = v
        elif op == "drop" and (ctl.running() or ctl.finished()):
            ctl.on_dropped(data.draw(st.sampled_from(ctl.running() + ctl.finished())))
        elif op == "train":
            batch = ctl.select_batch()
            if batch is None:
                # waiting must be able to end: with nothing running and G finished, a batch exists
                assert ctl.running() or len(ctl.finished()) < G
                continue
            start = ctl.version
            got = ctl.on_consumed(batch)
            want_stale = [start - gen_version[g] for g in batch]
            assert got == want_stale and max(got) <= eta
            consumed += len(batch)
            steps += 1
            ctl.on_step(start + U)
            if ctl.needs_sync():
                ctl.on_sync(ctl.trainer_version)
            assert ctl.trainer_version - ctl.server_version <= eta  # step-boundary lag stays admissible
        elif op == "early_sync":  # syncing more often than required is always allowed
            ctl.on_sync(ctl.trainer_version)
        elif op == "roundtrip":
            ctl = _roundtrip(ctl)
    assert ctl.consumed == consumed and ctl.steps == steps
    assert ctl.admitted == ctl.consumed + ctl.dropped + len(ctl.running()) + len(ctl.finished())


@pytest.mark.parametrize("eta,G,U", [(0, 3, 1), (5, 2, 1), (7, 4, 1), (8, 3, 4), (3, 2, 4), (256, 4, 4)])
def test_capacity_matches_areal_formula_without_sync_lag(eta, G, U):
    # One deadline class, lag 0: capacity = (floor(eta / U) + 1) * G - unconsumed; U = 1 is AReaL's
    # (eta + v + 1) * B - (accepted + running) after v steps of B consumed each.
    ctl = StalenessController(eta, G, U, sync_interval=1)
    assert ctl.capacity() == (eta // U + 1) * G
    assert ctl.try_admit(list(range(G + 1))) == min(G + 1, (eta // U + 1) * G)
    assert ctl.capacity() == (eta // U + 1) * G - min(G + 1, (eta // U + 1) * G)


def test_on_policy_degenerates_to_synchronous():
    ctl = StalenessController(max_staleness=0, groups_per_step=3, updates_per_step=4, sync_interval=4)
    gid = iter(range(1000))
    for step in range(5):
        assert ctl.capacity() == 3
        assert ctl.try_admit([next(gid) for _ in range(5)]) == 3  # exactly one step's worth
        assert ctl.capacity() == 0
        for g in ctl.running()[:2]:
            ctl.on_generated(g, ctl.server_version)
        assert ctl.select_batch() is None  # must wait for the third
        ctl.on_generated(ctl.running()[0], ctl.server_version)
        assert ctl.on_consumed(ctl.select_batch()) == [0, 0, 0]
        assert ctl.capacity() == 0  # nothing may start before the new weights reach the servers
        ctl.on_step(4 * (step + 1))
        assert ctl.needs_sync()
        ctl.on_sync(ctl.trainer_version)


def test_sync_lag_costs_capacity():
    # eta = 8, U = 2, sync every 4 updates: after one step without sync the servers lag 2 updates.
    ctl = StalenessController(8, groups_per_step=2, updates_per_step=2, sync_interval=4)
    assert ctl.capacity() == (8 // 2 + 1) * 2  # 10
    ctl.try_admit(list(range(2)))
    for g in range(2):
        ctl.on_generated(g, 0)
    ctl.on_consumed(ctl.select_batch())
    ctl.on_step(2)
    assert not ctl.needs_sync()
    # deadline of new groups = 0 + 8; steps at versions 2, 4, 6, 8 remain: 4 steps x 2 groups
    assert ctl.capacity() == 8
    ctl.on_consumed([])  # an empty step (e.g. everything filtered) still advances the version
    ctl.on_step(4)
    assert ctl.needs_sync()
    assert ctl.capacity() == 6
    ctl.on_sync(4)
    assert ctl.capacity() == 10


def test_a_step_that_applied_no_update_is_taken_back():
    # eta = 2, U = 1, G = 1. Step 0 consumes group 0 but every sample was dropped: the trainer stays at 0.
    ctl = StalenessController(2, groups_per_step=1)
    ctl.try_admit([0, 1, 2])
    for g in range(3):
        ctl.on_generated(g, 0)
    ctl.on_consumed([0])
    assert ctl.version == 1  # announced
    ctl.on_step(0, updates=0)
    assert ctl.version == ctl.trainer_version == 0
    # groups 1 and 2 (generated at 0) may still be trained at versions 0 and 1; one more fits (deadline 2)
    assert ctl.capacity() == 1
    assert ctl.on_consumed([1]) == [0]
    ctl.on_step(1, updates=1)
    assert ctl.on_consumed([2]) == [1]
    with pytest.raises(ValueError, match="announced 1 updates"):
        ctl.on_step(2, updates=3)
    with pytest.raises(StalenessBoundError, match="expected version 2"):
        ctl.on_step(1)  # without updates= the announced count must have happened


def test_rejects_a_sync_interval_that_starves_admission():
    with pytest.raises(ValueError, match="sync_interval <= 4"):
        StalenessController(max_staleness=3, groups_per_step=1, updates_per_step=4, sync_interval=5)
    StalenessController(max_staleness=3, groups_per_step=1, updates_per_step=4, sync_interval=4)
    with pytest.raises(ValueError, match="sync_interval <= 1"):
        StalenessController(max_staleness=0, groups_per_step=1, updates_per_step=1, sync_interval=2)


def test_newest_first_batching_breaks_the_bound_and_select_batch_does_not():
    """G = 1, eta = 2: A, B, C admitted at version 0. Training C then a later D leaves A and B both due
    at step 2 with one slot; select_batch refuses D at step 1 and picks A."""
    def setup():
        ctl = StalenessController(2, groups_per_step=1, updates_per_step=1, sync_interval=1)
        assert ctl.try_admit(["A", "B", "C", "x"]) == 3
        for g in "ABC":
            ctl.on_generated(g, 0)
        ctl.on_consumed(["C"])
        ctl.on_step(1)
        ctl.on_sync(1)
        assert ctl.try_admit(["D"]) == 1
        ctl.on_generated("D", 1)
        return ctl

    ctl = setup()
    ctl.on_consumed(["D"])  # the loop ignored select_batch
    ctl.on_step(2)
    ctl.on_sync(2)
    ctl.on_consumed(["A"])
    ctl.on_step(3)
    assert ctl.overdue() == ["B"]
    with pytest.raises(StalenessBoundError, match="staleness 3 > max_staleness = 2"):
        ctl.on_consumed(["B"])
    with pytest.raises(StalenessBoundError, match="drop them with reason 'too_stale'"):
        ctl.select_batch()
    ctl.on_dropped("B")
    assert ctl.overdue() == []

    ctl = setup()
    assert ctl.select_batch() == ["A"]
    assert ctl.select_batch(finished=["D"]) is None  # D alone would strand A or B


def test_waits_for_a_running_group_that_must_go_next():
    ctl = StalenessController(1, groups_per_step=1, updates_per_step=1, sync_interval=1)
    assert ctl.try_admit(["old1", "old2"]) == 2  # both due by version 1
    ctl.on_generated("old1", 0)
    ctl.on_consumed(ctl.select_batch())
    ctl.on_step(1)
    ctl.on_sync(1)
    assert ctl.try_admit(["new"]) == 1
    ctl.on_generated("new", 1)
    assert ctl.select_batch() is None  # old2 is due now and still running
    ctl.on_generated("old2", 0)
    assert ctl.select_batch() == ["old2"]


def test_tokens_older_than_admission_are_rejected():
    # A partial rollout continued from a prefix generated before its admission would escape the bound.
    ctl = StalenessController(4, groups_per_step=1, updates_per_step=1, sync_interval=1)
    ctl.try_admit(["a"])
    ctl.on_generated("a", 0)
    ctl.on_consumed(["a"])
    ctl.on_step(1)
    ctl.on_sync(1)
    ctl.try_admit(["b"])
    with pytest.raises(StalenessBoundError, match="older than the server version 1 at its admission"):
        ctl.on_generated("b", 0)
    with pytest.raises(StalenessBoundError, match="servers are at 1"):
        ctl.on_generated("b", 2)


def test_illegal_calls_raise_clear_errors():
    ctl = StalenessController(2, groups_per_step=2)
    ctl.try_admit(["a", "b"])
    with pytest.raises(ValueError, match="already admitted"):
        ctl.try_admit(["a"])
    with pytest.raises(ValueError, match="still generating"):
        ctl.on_consumed(["a"])
    with pytest.raises(ValueError, match="not admitted"):
        ctl.on_generated("zz", 0)
    with pytest.raises(TypeError, match="must be int or str"):
        ctl.try_admit([1.5])
    ctl.on_generated("a", 0)
    with pytest.raises(ValueError, match="already generated"):
        ctl.on_generated("a", 0)
    ctl.on_generated("b", 0)
    ctl.on_consumed(["a", "b"])
    with pytest.raises(StalenessBoundError, match="expected version 1"):
        ctl.on_step(4)
    with pytest.raises(ValueError, match="not admitted"):
        ctl.on_dropped("a")
    with pytest.raises(StalenessBoundError, match="cannot pass the trainer"):
        ctl.on_sync(1)  # the trainer has not reported the step yet
    with pytest.raises(ValueError, match="max_staleness = -1"):
        StalenessController(-1, 1)


def test_resume_may_change_max_staleness():
    ctl = StalenessController(4, groups_per_step=2, updates_per_step=1)
    ctl.try_admit(list(range(6)))
    state = json.loads(json.dumps(ctl.state_dict()))
    tighter = StalenessController(1, groups_per_step=2, updates_per_step=1)
    tighter.load_state_dict(state)
    assert tighter.deadline(0) == 1 and tighter.capacity() == 0
    assert tighter.running() == list(range(6))
