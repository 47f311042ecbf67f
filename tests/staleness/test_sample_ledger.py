"""SampleLedger: one end state per sample, generated = consumed + dropped + pending, step statistics."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m2po_megatron.staleness import DROP_REASONS, LedgerError, SampleLedger


@settings(max_examples=50, deadline=None)
@given(data=st.data(), history=st.integers(1, 50))
def test_identity_holds_under_random_operations(data, history):
    led = SampleLedger(history=history)
    pending: set[int] = set()
    consumed = dropped = 0
    by_reason = {r: 0 for r in DROP_REASONS}
    next_id, version = 0, 0
    for _ in range(data.draw(st.integers(1, 60))):
        op = data.draw(st.sampled_from(["add", "consume", "drop", "step", "roundtrip"]))
        if op == "add":
            n = data.draw(st.integers(0, 5))
            led.add(range(next_id, next_id + n))
            pending |= set(range(next_id, next_id + n))
            next_id += n
        elif op in ("consume", "drop") and pending:
            ids = data.draw(st.lists(st.sampled_from(sorted(pending)), min_size=1, max_size=4, unique=True))
            if op == "consume":
                led.consume(ids, version, [version] * len(ids))
                consumed += len(ids)
            else:
                reason = data.draw(st.sampled_from(DROP_REASONS))
                led.drop(ids, reason)
                dropped += len(ids)
                by_reason[reason] += len(ids)
            pending -= set(ids)
        elif op == "step":
            m = led.end_step(pending=len(pending))
            assert m["samples/generated"] == next_id
            assert m["samples/consumed"] == consumed and m["samples/dropped"] == dropped
            assert m["samples/pending"] == len(pending)
            assert all(m[f"samples/dropped/{r}"] == c for r, c in by_reason.items())
            version += 1
        elif op == "roundtrip":
            fresh = SampleLedger(history=history)
            fresh.load_state_dict(json.loads(json.dumps(led.state_dict())))
            assert fresh.state_dict() == led.state_dict()
            led = fresh
    led.check(pending=len(pending))
    assert led.generated == led.consumed + sum(led.dropped.values()) + led.pending


def test_step_staleness_statistics():
    led = SampleLedger()
    led.add(["a", "b", "c", "d"])
    # a: one version; b: partial rollout over versions 3..5; trainer at version 6
    assert led.consume(["a", "b"], 6, [2, [3, 3, 5, 4]]) == [4, 3]
    m = led.end_step()
    assert m["staleness/mean"] == 3.5 and m["staleness/max"] == 4 and m["staleness/min"] == 3
    assert m["staleness/token_mean"] == pytest.approx((3 + 3 + 1 + 2) / 4)  # per-token, only b gave tokens
    m = led.end_step()
    assert "staleness/mean" not in m  # nothing consumed in this step
    led.consume(["c"], 7, [7])
    assert led.end_step()["staleness/max"] == 0
    assert "staleness/token_mean" not in led.end_step()


def test_illegal_transitions_raise():
    led = SampleLedger()
    led.add([1, 2, 3])
    led.consume([1], 0, [0])
    with pytest.raises(LedgerError, match="sample 1 is consumed, not pending"):
        led.consume([1], 1, [0])
    with pytest.raises(LedgerError, match="sample 1 is consumed, not pending"):
        led.drop([1], "filtered")
    led.drop([2], "aborted")
    with pytest.raises(LedgerError, match=r"sample 2 is dropped \(aborted\), not pending"):
        led.consume([2], 1, [0])
    with pytest.raises(LedgerError, match="sample 99 is unknown"):
        led.drop([99], "aborted")
    with pytest.raises(LedgerError, match="reason 'bored' is not one of"):
        led.drop([3], "bored")
    with pytest.raises(LedgerError, match="already exists"):
        led.add([3])
    with pytest.raises(LedgerError, match="duplicate"):
        led.consume([3, 3], 1, [0, 0])
    with pytest.raises(LedgerError, match="outside 0..1"):
        led.consume([3], 1, [2])
    with pytest.raises(LedgerError, match="2 behaviour_versions"):
        led.consume([3], 1, [0, 0])
    with pytest.raises(TypeError, match="must be int or str"):
        led.add([(1, 2)])
    # a failed call changed nothing
    assert led.is_pending(3) and led.consumed == 1


def test_mismatch_with_the_loop_is_reported():
    led = SampleLedger()
    led.add(range(5))
    led.consume([0, 1], 0, [0, 0])
    led.end_step(pending=3)
    with pytest.raises(LedgerError, match="holds 2 samples .* ledger has 3 pending"):
        led.end_step(pending=2)


def test_corrupt_state_is_rejected():
    led = SampleLedger()
    led.add(range(3))
    led.drop([0], "filtered")
    state = led.state_dict()
    state["generated"] = 7
    with pytest.raises(LedgerError, match="generated 7 != consumed 0 \\+ dropped 1 \\+ pending 2"):
        SampleLedger().load_state_dict(state)


def test_history_forgets_old_terminal_ids_but_counts_stay_exact():
    led = SampleLedger(history=2)
    led.add(range(4))
    led.consume([0, 1, 2], 0, [0, 0, 0])
    with pytest.raises(LedgerError, match="sample 0 is unknown"):
        led.consume([0], 0, [0])
    with pytest.raises(LedgerError, match="sample 2 is consumed"):
        led.consume([2], 0, [0])
    assert led.counters()["samples/consumed"] == 3
