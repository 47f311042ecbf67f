"""R3 routing data as part of a sample: SGLang's wire format decoded, every unusable record dropped with its
counted reason (ledger `bad_routing`, metric routing/dropped/<problem>), the record carried through the
staleness buffer's checkpoint, and requested only when wanted."""
import base64
import json

import numpy as np
import pytest
import torch

from m2po_megatron.rollout import routing
from m2po_megatron.rollout.client import SampleResult, build_batch_body, build_generate_body
from m2po_megatron.rollout.groups import GroupMaker, RoutingSpec, group_from_dict, group_to_dict
from m2po_megatron.rollout.samples import Group, build_step_batch
from m2po_megatron.staleness import SampleLedger

L, K, E = 3, 2, 8
PROMPT = [4, 5, 6]


def good(rows: int, seed: int = 0) -> np.ndarray:
    """[rows, L, K] distinct expert ids per token and layer."""
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(rows)])


def test_wire_round_trip_and_compact_storage():
    a = good(5)
    wire = routing.encode(a)
    assert len(base64.b64decode(wire)) == a.size * 4  # SGLang's int32
    np.testing.assert_array_equal(routing.decode(wire, num_layers=L, topk=K), a)
    arr, problem = routing.parse(wire, num_layers=L, topk=K, num_experts=E, num_tokens=5)
    assert problem is None and arr.dtype == np.int16 and arr.flags.writeable
    np.testing.assert_array_equal(arr, a)
    big, _ = routing.parse(routing.encode(a + 40000), num_layers=L, topk=K, num_experts=40000 + E, num_tokens=5)
    assert big.dtype == np.int32 and big.max() >= 40000  # ids past int16 keep int32
    assert routing.expected_rows(3, 4) == 6 and routing.expected_rows(1, 0) == 0


def _problem(b64, rows=5):
    return routing.parse(b64, num_layers=L, topk=K, num_experts=E, num_tokens=rows)[1]


def test_each_unusable_record_has_its_reason():
    a = good(5)
    assert _problem(None) == "routing_missing"
    assert _problem("not base64!") == "routing_undecodable"
    assert _problem(base64.b64encode(b"\x00" * 6).decode()) == "routing_undecodable"  # 1.5 int32 values
    assert _problem(routing.encode(good(5)[:, :2])) == "routing_layers"  # 2 layers instead of 3
    assert _problem(routing.encode(np.concatenate([a, a], axis=1))) == "routing_layers"  # 6 layers
    assert _problem(routing.encode(a[:, :, :1])) == "routing_topk"  # top-1 instead of top-2
    assert _problem(routing.encode(a), rows=6) == "routing_length"  # one row short
    assert _problem(routing.encode(a[:4])) == "routing_length"
    assert _problem(routing.encode(np.zeros((1, 1, 1)))) == "routing_length"  # no whole row at all
    bad = a.copy()
    bad[2, 1, 0] = E
    assert _problem(routing.encode(bad)) == "routing_expert_range"
    bad[2, 1, 0] = -1
    assert _problem(routing.encode(bad)) == "routing_expert_range"
    dup = a.copy()
    dup[4, 2, 1] = dup[4, 2, 0]
    assert _problem(routing.encode(dup)) == "routing_duplicate_expert"
    assert set(routing.ROUTING_PROBLEMS) >= {_problem(None), "routing_duplicate_expert"}
    assert routing.routing_problem(a, num_layers=L, topk=K, num_experts=E, num_tokens=5) is None
    assert routing.routing_problem(a.astype(float), num_layers=L, topk=K, num_experts=E, num_tokens=5) \
        == "routing_undecodable"


def test_checkpoint_state_round_trip():
    for dtype in (np.int16, np.int32):
        a = good(4).astype(dtype)
        back = routing.from_state(json.loads(json.dumps(routing.to_state(a))))
        assert back.dtype == dtype and back.flags.writeable
        np.testing.assert_array_equal(back, a)
    assert routing.to_state(None) is None and routing.from_state(None) is None
    with pytest.raises(ValueError, match="int16"):
        routing.from_state({"dtype": "float32", "shape": [1], "b64": ""})


def _result(out, b64, finish="stop"):
    return SampleResult(output_ids=out, output_logprobs=[-1.0] * len(out), token_versions=[0] * len(out),
                        finish_reason=finish, prompt_tokens=len(PROMPT), weight_version=0, routed_experts=b64)


def _maker(n):
    return GroupMaker(None, None, None, None, {}, n=n, seed=0, routing=RoutingSpec(L, K, E))


def test_bad_records_are_dropped_with_a_counted_reason():
    out = [7, 8, 9]
    rows = routing.expected_rows(len(PROMPT), len(out))
    m = _maker(4)
    g = m.fill(Group(group_id="g0", prompt_id="p", prompt_ids=PROMPT, answer="1"), [
        _result(out, routing.encode(good(rows))),
        _result(out, routing.encode(good(rows - 1))),  # one row short
        _result(out, None),  # no record although asked
        _result(out, None, finish="abort"),  # aborted: dropped as such, no record needed
    ])
    assert [s.routing_problem for s in g.samples] == [None, "routing_length", "routing_missing", None]
    assert g.samples[0].routed_experts.shape == (rows, L, K) and g.samples[3].routed_experts is None
    for s, r in zip(g.samples, (1.0, 0.0, 1.0, 0.0)):
        s.reward = r
    ledger = SampleLedger()
    ledger.add(g.sample_ids)
    step = build_step_batch([g], 0, ledger)
    c = ledger.counters()
    assert [s.sample_id for s in step.samples] == ["g0/0"]
    assert (c["samples/dropped/bad_routing"], c["samples/dropped/aborted"], c["samples/consumed"]) == (2, 1, 1)
    assert step.metrics["samples/dropped_this_step"] == 3
    extra = m.stats(0.0).extra
    assert extra["routing/dropped/routing_length"] == 1 and extra["routing/dropped/routing_missing"] == 1
    assert "routing/dropped/routing_length" not in m.stats(0.0).extra  # counted once


def test_a_server_that_never_sends_routing_is_a_setup_error():
    with pytest.raises(RuntimeError, match="--enable-return-routed-experts"):
        _maker(1).fill(Group(group_id="g0", prompt_id="p", prompt_ids=PROMPT, answer="1"), [_result([7], None)])


def test_routing_travels_through_the_buffer_checkpoint(tmp_path):
    """group_to_dict is what both generators' state_dict (the async buffer, the fixed-lag queue) store in
    run_state.json: the record comes back with its values, shape and compact dtype."""
    from m2po_megatron.run.state import load_run_state, save_run_state

    out = [7, 8]
    rows = routing.expected_rows(len(PROMPT), len(out))
    g = _maker(2).fill(Group(group_id="g3", prompt_id="p", prompt_ids=PROMPT, answer="1"),
                       [_result(out, routing.encode(good(rows, 1))), _result(out, routing.encode(good(rows, 2)))])
    save_run_state(tmp_path / "run_state.json", {"generator": {"finished": [group_to_dict(g)]}})
    back = group_from_dict(load_run_state(tmp_path / "run_state.json")["generator"]["finished"][0])
    for s0, s1 in zip(g.samples, back.samples):
        assert s1.routed_experts.dtype == np.int16 and s1.routing_problem is None
        np.testing.assert_array_equal(s1.routed_experts, s0.routed_experts)
    plain = Group(group_id="g4", prompt_id="p", prompt_ids=PROMPT, answer="1",
                  samples=[g.samples[0].__class__(**dict(g.samples[0].__dict__, routed_experts=None))])
    assert group_from_dict(json.loads(json.dumps(group_to_dict(plain)))).samples[0].routed_experts is None


def test_the_field_is_sent_only_when_wanted():
    assert "return_routed_experts" not in build_generate_body([1, 2], {"max_new_tokens": 2}, "r")
    assert build_generate_body([1, 2], {"max_new_tokens": 2}, "r", return_routed_experts=True)[
        "return_routed_experts"] is True
    assert build_batch_body([1, 2], {}, [1, 2], return_routed_experts=True)["return_routed_experts"] is True


def test_the_step_batch_carries_one_row_per_input_token():
    """TrainBatch.routed_experts (the trainer's replay input): the engine's rows, then -1 for the last token."""
    out = [7, 8, 9]
    rows = routing.expected_rows(len(PROMPT), len(out))
    g = _maker(2).fill(Group(group_id="g0", prompt_id="p", prompt_ids=PROMPT, answer="1"),
                       [_result(out, routing.encode(good(rows, 1))), _result(out, routing.encode(good(rows, 2)))])
    for s, r in zip(g.samples, (1.0, 0.0)):
        s.reward = r
    ledger = SampleLedger()
    ledger.add(g.sample_ids)
    batch = build_step_batch([g], 0, ledger).batch
    batch.validate(for_training=True)
    for s, r in zip(g.samples, batch.routed_experts):
        assert r.shape == (len(PROMPT) + len(out), L, K) and r.dtype == torch.int16  # compact: it travels to every rank
        np.testing.assert_array_equal(r[:-1].numpy(), s.routed_experts)
        assert (r[-1] == -1).all()
