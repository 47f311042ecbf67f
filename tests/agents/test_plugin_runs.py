"""Real runs with rollout plug-ins (Ray, a Megatron rank, the CPU rollout server): a two-turn function
trains with its environment tokens masked in each staleness mode and with what it composes with, a function
that always fails stops the run with its reason, and `m2po config` refuses a bad one. (Malformed results
dropped with counted reasons while the run goes on: test_feedback_plugin.py, whose plug-in was written from
docs/agents.md alone.)"""
import json
from pathlib import Path

import pytest

from tests.loop.test_train_runs import (RUN_TIMEOUT, assert_accounting, m2po, ok, overrides,  # noqa: F401
                                        small_eval, steps)

PLUGINS = Path(__file__).resolve().parent / "plugins.py"


def fn(name: str) -> str:
    return f"rollout.function={PLUGINS}:{name}"


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_two_turn_function_trains_with_environment_tokens_masked_and_resumes(tiny_task, tmp_path):
    """Bounded staleness (episodes admitted at their first turn, each token with its own version) with GSPO, the
    three-policy objective (MIS) against a bf16 server and in_place pauses; a checkpoint at step 2 (episodes in
    flight are dropped as interrupted, buffered masked samples saved) and a resume to step 3."""
    args = [fn("two_turns"), "algo.name=gspo", "staleness.mode=bounded", "staleness.max_staleness=2",
            "staleness.sync_interval=1", "rollout.pause_mode=in_place", "rollout.dtype=bfloat16",
            "algo.rollout_correction.mode=mis", "algo.rollout_correction.threshold=1.5", "rollout.max_new_tokens=12",
            "checkpoint.interval=2"]
    p = m2po("train", "tiny-cpu", *overrides(tiny_task, tmp_path, "two", *args, "train.steps=2"))
    ok(p)
    assert "exception calling callback" not in p.stdout + p.stderr  # e.g. the timeline's span of a group
    ok(m2po("train", "tiny-cpu", *overrides(tiny_task, tmp_path, "two", *args, "train.steps=3", "run.resume=auto")))
    rows = steps(tmp_path / "two")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert_accounting(rows)
    logged = [r for r in rows if "rollout/custom/turns" in r]  # steps whose batch came from the buffer log none
    assert logged and all(r["rollout/custom/turns"] == 2.0 and r["rollout/custom/same_server"] == 1.0 for r in logged)
    for r in rows:
        assert 0 < r["response/env_token_frac"] < 1 and r["batch/policy_tokens"] < r["batch/tokens"]
        assert r["staleness/max"] <= 2
        assert not any(k.startswith("rollout_fn/dropped/") for k in r), r
        # the loss's denominator: the policy's tokens only (less those MIS rejected)
        assert 0 < r["num_tokens"] <= r["batch/policy_tokens"] and r["rollout_corr/kl_k1"] != 0


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_a_function_that_always_fails_stops_the_run_with_its_reason(tiny_task, tmp_path):
    p = m2po("train", "tiny-cpu", *overrides(tiny_task, tmp_path, "fails", fn("always_raises"), "train.steps=3"))
    assert p.returncode != 0
    out = p.stdout + p.stderr
    assert "every episode of the first step failed" in out and "my environment is not configured" in out, out[-3000:]


@pytest.mark.parametrize("name,message", [("not_async", "is not an async function"),
                                          ("two_args", "must take exactly one argument"),
                                          ("missing", "has no attribute 'missing'")])
def test_config_refuses_a_bad_function_before_anything_starts(tmp_path, name, message):
    p = m2po("config", "tiny-cpu", "--no-check-files", fn(name), timeout=120)
    assert p.returncode == 2, p.stderr
    assert "rollout.function" in p.stderr and message in p.stderr, p.stderr


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_two_turns_compose_fixed_lag_dp2_filter_groups_trainer_logprobs_eval_and_resume(tiny_task, tmp_path,
                                                                                        small_eval):
    """fixed_lag with DP 2, filter_groups, behaviour log-probs recomputed by the trainer, in-run evaluation
    through the same function, a checkpoint and a resume: the masked samples of the lag's buffer come back."""
    args = [fn("two_turns"), "staleness.mode=fixed_lag", "staleness.lag_steps=1", "staleness.behav_logprob_source=trainer",
            "parallel.data_parallel_size=2", "parallel.tensor_model_parallel_size=1", "train.filter_groups.enable=true",
            "train.filter_groups.max_num_gen_batches=2", f"data.eval_paths=[{small_eval}]", "eval.interval=2",
            "eval.n_samples=2", "checkpoint.interval=2", "rollout.max_new_tokens=12"]
    ok(m2po("train", "tiny-cpu", *overrides(tiny_task, tmp_path, "lag", *args, "train.steps=2")))
    ok(m2po("train", "tiny-cpu", *overrides(tiny_task, tmp_path, "lag", *args, "train.steps=3", "run.resume=auto")))
    rows = steps(tmp_path / "lag")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert_accounting(rows)
    trained = [r for r in rows if "batch/sequences" in r]  # filter_groups may leave a step nothing to train
    assert trained and all(0 < r["response/env_token_frac"] < 1 and r["staleness/max"] <= 2 for r in trained)
    mismatch = [r["engine_mismatch/kl_k1"] for r in rows if "engine_mismatch/kl_k1" in r]
    assert mismatch and all(abs(k) < 1e-4 for k in mismatch)  # policy tokens only, at equal weights
    evals = [r for r in (json.loads(x) for x in (tmp_path / "lag" / "metrics.jsonl").read_text().splitlines())
             if any(k.endswith("/pass@1") for k in r)]
    assert evals and all(r["eval_fn/custom/turns"] == 2.0 and 0 <= r["eval/avg/pass@1"] <= 100 for r in evals)


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_two_turns_with_r3_replay_on_the_tiny_moe(moe_task, tmp_path):
    """R3 with a multi-turn episode: the last turn's routed experts cover the whole context (the environment's
    tokens included, as the engine prefilled them) and replay in the trainer; EP 2 over DP 2."""
    p = m2po("train", "tiny-cpu", *overrides(moe_task, tmp_path, "moe", fn("two_turns"), "algo.routing_replay=r3",
                                             "parallel.tensor_model_parallel_size=1", "parallel.data_parallel_size=2",
                                             "parallel.expert_model_parallel_size=2",
                                             "parallel.use_distributed_optimizer=true", "staleness.mode=bounded",
                                             "staleness.max_staleness=2", "train.steps=2"))
    ok(p)
    rows = steps(tmp_path / "moe")
    assert_accounting(rows)
    for r in rows:
        assert r["samples/dropped/bad_routing"] == 0 and r["routing/replayed_seqs"] > 0 and r["routing/replayed_tokens"] > 0
        assert 0 < r["response/env_token_frac"] < 1
