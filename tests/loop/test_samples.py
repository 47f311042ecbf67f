"""The step batch: advantages over kept samples, drops with reasons, and the ledger identity."""
import pytest
import torch

from m2po_megatron.data.prompts import PromptStream
from m2po_megatron.rollout.generators import group_from_dict, group_to_dict
from m2po_megatron.rollout.samples import Group, Sample, build_step_batch, sample_ids_for
from m2po_megatron.staleness import SampleLedger


def group(gid, rewards, versions=0, finish=None, empty=()):
    g = Group(group_id=gid, prompt_id=gid, prompt_ids=[1, 2, 3], answer="4")
    for i, (sid, r) in enumerate(zip(sample_ids_for(gid, len(rewards)), rewards)):
        out = [] if i in empty else [5, 6]
        v = versions[i] if isinstance(versions, list) else versions
        g.samples.append(Sample(sid, gid, [1, 2, 3], out, [-0.5] * len(out), [v] * len(out),
                                (finish or {}).get(i, "stop"), "4", r))
    return g


def test_advantages_ledger_and_batch_layout():
    led = SampleLedger()
    gs = [group("a", [1.0, 0.0, 1.0, 0.0]), group("b", [1.0, 1.0, 1.0, 1.0])]
    for g in gs:
        led.add(g.sample_ids)
    sb = build_step_batch(gs, version=3, ledger=led)
    adv = sb.batch.advantages
    # group a: mean 0.5, unbiased std 0.577 -> +-0.866; group b: all equal -> 0
    assert torch.allclose(adv[:4], torch.tensor([0.866, -0.866, 0.866, -0.866]), atol=1e-3)
    assert torch.all(adv[4:] == 0)
    assert sb.batch.prompt_lens == [3] * 8 and sb.batch.input_ids[0].tolist() == [1, 2, 3, 5, 6]
    assert sb.metrics["reward/mean"] == 0.75
    out = led.end_step(pending=0)
    assert out["samples/consumed"] == 8 and out["staleness/mean"] == 3 and out["staleness/token_mean"] == 3


def test_drops_are_counted_and_excluded_from_baseline():
    led = SampleLedger()
    g = group("a", [1.0, 0.0, 1.0, 1.0], versions=[5, 5, 0, 5], finish={1: "abort"}, empty=(3,))
    led.add(g.sample_ids)
    sb = build_step_batch([g], version=6, ledger=led, max_staleness=4)
    # sample 1 aborted, 3 empty, 2 too stale (6 - 0 > 4): only sample 0 is trained, advantage 0 (alone)
    assert len(sb.batch) == 1 and float(sb.batch.advantages[0]) == 0.0
    c = led.end_step(pending=0)
    assert (c["samples/dropped/aborted"], c["samples/dropped/filtered"], c["samples/dropped/too_stale"]) == (1, 1, 1)
    assert c["samples/generated"] == c["samples/consumed"] + c["samples/dropped"] + c["samples/pending"]


def test_keep_too_stale_when_asked():
    led = SampleLedger()
    g = group("a", [1.0, 0.0], versions=0)
    led.add(g.sample_ids)
    sb = build_step_batch([g], version=10, ledger=led, max_staleness=4, drop_too_stale=False)
    assert len(sb.batch) == 2 and led.end_step()["staleness/max"] == 10


def test_all_dropped_gives_no_batch():
    led = SampleLedger()
    g = group("a", [1.0], finish={0: "abort"})
    led.add(g.sample_ids)
    assert build_step_batch([g], 0, led).batch is None
    assert led.end_step(pending=0)["samples/dropped"] == 1


def test_unscored_sample_is_an_error():
    led = SampleLedger()
    g = group("a", [None])
    led.add(g.sample_ids)
    with pytest.raises(ValueError, match="without a reward"):
        build_step_batch([g], 0, led)


def test_prompt_stream_epochs_and_resume():
    rows = [{"id": i, "prompt": str(i), "answer": str(i)} for i in range(5)]
    a = PromptStream(rows, seed=1)
    first = [a.next()["id"] for _ in range(7)]
    assert sorted(first[:5]) == list(range(5))  # one full epoch before any repeat
    b = PromptStream(rows, seed=1)
    for _ in range(3):
        b.next()
    c = PromptStream(rows, seed=1)
    c.load_state_dict(b.state_dict())
    assert [c.next()["id"] for _ in range(4)] == first[3:7]


def test_group_round_trip():
    g = group("a", [1.0, 0.0])
    assert group_to_dict(group_from_dict(group_to_dict(g))) == group_to_dict(g)
