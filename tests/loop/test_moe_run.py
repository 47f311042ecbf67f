"""A short real run of a Qwen3-MoE on CPU (issue 37's embedded check): Ray, two Megatron ranks with expert
parallelism 2 over gloo, the CPU rollout server recording each token's experts, rollout routing replay (R3) in
the trainer, a checkpoint and a resume with the replay data in the buffer. The model is the tiny task's shapes
with 4 experts (top-2), randomly initialised: this checks the pipeline, not learning."""
import pytest

from test_train_runs import RUN_TIMEOUT, assert_accounting, m2po, ok, overrides, steps


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_moe_ep2_r3_run_and_resume(moe_task, tmp_path):
    args = ["parallel.tensor_model_parallel_size=1", "parallel.data_parallel_size=2",
            "parallel.expert_model_parallel_size=2", "parallel.use_distributed_optimizer=true",
            "algo.routing_replay=r3", "staleness.mode=bounded", "staleness.max_staleness=2",
            "staleness.sync_interval=2", "checkpoint.interval=2"]
    ok(m2po("train", "tiny-cpu", *overrides(moe_task, tmp_path, "moe", *args, "train.steps=2")))
    ok(m2po("train", "tiny-cpu", *overrides(moe_task, tmp_path, "moe", *args, "train.steps=3", "run.resume=auto")))
    rows = steps(tmp_path / "moe")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert_accounting(rows)
    for r in rows:
        assert r["samples/consumed"] > 0 and r["samples/dropped/bad_routing"] == 0, r
        # every consumed sequence came with the engine's routing and was replayed in both layers
        assert r["routing/replayed_seqs"] > 0 and r["routing/replayed_tokens"] > 0
        assert {"routing/mismatch/layer_0", "routing/mismatch/layer_1", "routing/load_max_over_mean",
                "routing/logprob_mismatch", "routing/logprob_mismatch_noreplay"} <= set(r)
        assert 0.0 <= r["routing/mismatch"] <= 1.0 and r["routing/load_max_over_mean"] >= 1.0
