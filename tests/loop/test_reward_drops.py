"""The step batch under the reward's failure policy and DAPO's over-long filtering: a sample whose reward
failed (reward.on_error = drop) is dropped as reward_error and never shifts its siblings' baseline; a truncated
sample (algo.overlong_filtering) stays in its group's baseline, leaves the trainer's batch, and is counted."""
import torch

from m2po_megatron.algo import grpo_advantages
from m2po_megatron.rollout.groups import group_from_dict, group_to_dict
from m2po_megatron.rollout.samples import Group, Sample, build_step_batch, sample_ids_for
from m2po_megatron.staleness import SampleLedger


def group(gid, rewards, finish=None, reward_problem=None):
    g = Group(group_id=gid, prompt_id=gid, prompt_ids=[1, 2, 3], answer="4")
    for i, (sid, r) in enumerate(zip(sample_ids_for(gid, len(rewards)), rewards)):
        g.samples.append(Sample(sid, gid, [1, 2, 3], [5, 6], [-0.5, -0.5], [0, 0], (finish or {}).get(i, "stop"),
                                "4", r, reward_problem=(reward_problem or {}).get(i)))
    return g


def test_a_failed_reward_is_dropped_as_reward_error_and_left_out_of_the_baseline():
    led = SampleLedger()
    g = group("a", [1.0, None, 0.0, 1.0], reward_problem={1: "timeout"})
    led.add(g.sample_ids)
    sb = build_step_batch([g], version=0, ledger=led)
    assert len(sb.samples) == 3 and all(s.sample_id != "a/1" for s in sb.samples)
    expect = grpo_advantages(torch.tensor([1.0, 0.0, 1.0]), group_ids=torch.zeros(3, dtype=torch.long))
    assert torch.allclose(sb.batch.advantages, expect)
    out = led.end_step(pending=0)
    assert out["samples/dropped/reward_error"] == 1 and out["samples/consumed"] == 3
    assert out["samples/generated"] == out["samples/consumed"] + out["samples/dropped"]
    # the reason survives a checkpoint of a buffered group
    again = group_from_dict(group_to_dict(g))
    assert again.samples[1].reward_problem == "timeout"


def test_overlong_filtering_keeps_the_baseline_and_masks_the_truncated_from_the_loss():
    gs = [group("a", [1.0, 0.0, 0.0, 1.0], finish={0: "length", 2: "length"}), group("b", [0.0, 1.0])]
    plain_led, led = SampleLedger(), SampleLedger()
    for g in gs:
        plain_led.add(g.sample_ids), led.add(g.sample_ids)
    plain = build_step_batch(gs, version=0, ledger=plain_led)
    sb = build_step_batch(gs, version=0, ledger=led, overlong_filtering=True)
    kept = [s.sample_id for s in sb.samples]
    assert kept == ["a/1", "a/3", "b/0", "b/1"] and sb.metrics["overlong/filtered"] == 2
    # the kept samples' advantages are the ones computed with the truncated samples in the baseline
    full = dict(zip([s.sample_id for s in plain.samples], plain.batch.advantages.tolist()))
    assert sb.batch.advantages.tolist() == [full[k] for k in kept]
    assert len(sb.batch.input_ids) == 4 and sb.metrics["reward/mean"] == plain.metrics["reward/mean"]
    out = led.end_step(pending=0)
    assert out["samples/consumed"] == 6 and out["samples/dropped"] == 0  # used for the baseline: consumed


def test_overlong_filtering_of_a_step_of_truncated_samples_trains_nothing():
    led = SampleLedger()
    g = group("a", [1.0, 0.0], finish={0: "length", 1: "length"})
    led.add(g.sample_ids)
    sb = build_step_batch([g], version=0, ledger=led, overlong_filtering=True)
    assert sb.batch is None and sb.metrics["overlong/filtered"] == 2 and sb.metrics["reward/mean"] == 0.5
    assert led.end_step(pending=0)["samples/consumed"] == 2
