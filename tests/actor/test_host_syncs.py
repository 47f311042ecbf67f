"""No host sync inside the micro-batch loop: the real MegatronActor on CPU (one gloo rank, TP1) runs the same
work as 2 and as 6 micro-batches, and the points where a CUDA run would wait for the device (`.item()` and
float/int/bool of a tensor, `.tolist()`, `.cpu()`, `nonzero` and what needs it, blocking host-to-device copies;
counted by tests/actor/sync_workers.SyncCounter) are as many in both, in train_step and in
compute_log_probs. Also: a NaN input still raises, naming the tensor, and leaves the weights alone; the fused
grad norm equals megatron's own at TP2."""
import pytest

import sync_workers as sw
from m2po_megatron.actor.actor import STEP_TIMES
from m2po_megatron.actor.launch import run_multiprocess

# Every loss on the dense-mask "local" path, and M2PO's batch-level mask on "sdpa" (the CPU's default: a
# PackedRow per micro-batch, the per-sequence kernel on CPU, RoPE from position ids).
SETTINGS = [dict(loss_name="m2po", m2po_scope="global", attention_backend="local"),
            dict(loss_name="m2po", m2po_scope="microbatch", attention_backend="local"),
            dict(loss_name="gspo", attention_backend="local"),
            dict(loss_name="m2po", m2po_scope="global", attention_backend="sdpa")]


@pytest.mark.timeout(500)
def test_host_sync_count_does_not_grow_with_micro_batches():
    jobs = [dict(s, n_mb=n) for s in SETTINGS for n in (2, 6)]
    out = run_multiprocess(sw.count_worker, 1, args=(jobs,), timeout=480)[0]
    for i, s in enumerate(SETTINGS):
        two, six = out[2 * i], out[2 * i + 1]
        assert (two["num_microbatches"], six["num_microbatches"]) == (2, 6), s
        assert six["train"] == two["train"], (s, two["train"], six["train"])
        assert six["logp"] == two["logp"], (s, two["logp"], six["logp"])
        assert six["loss"] == pytest.approx(two["loss"], rel=1e-5), s  # the same work
        # and the counters see what they should: the update's reads, one copy to the host of the log-probs
        assert two["train"].get("item", 0) > 0 and two["logp"].get("cpu", 0) == 1, s
        # the step's parts, timed on the host without a sync (benchmarks/bench_step.py), lie within the call
        t = six["times"]
        assert set(t) == {f"time/actor/{k}" for k in (*STEP_TIMES, "train_step")}, t
        assert min(t.values()) >= 0 and sum(t.values()) - t["time/actor/train_step"] <= t["time/actor/train_step"]
        assert (t["time/actor/logprob_pass"] > 0) == (s.get("m2po_scope") == "global"), (s, t)


@pytest.mark.timeout(300)
def test_nan_advantage_raises_at_the_update_and_weights_stay():
    out = run_multiprocess(sw.nonfinite_worker, 1, timeout=280)[0]
    assert out["error"] is not None and "advantages contains NaN or inf at 13 valid token(s)" in out["error"], out
    assert "mask those tokens out" in out["error"]
    assert out["moved"] == 0.0 and out["updates"] == 0
    assert out["moved_after"] > 0.0  # the next, finite step trains


@pytest.mark.timeout(400)
@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_fused_grad_norm_equals_megatron_at_tp2(distributed_optimizer):
    out = run_multiprocess(sw.grad_norm_worker, 2, args=(distributed_optimizer,), timeout=380)
    for r in out:
        assert r["fused"] == pytest.approx(r["megatron"], rel=1e-6, abs=0.0), r  # bit-equal here (CPU)
        assert r["hooked"] and r["step"] == r["fused"], r  # the step used ours (no TE/Apex here) on these grads
        assert abs(r["all_params"] - r["megatron"]) > 1e-6 * r["megatron"], r  # duplicates would change it
    assert out[1]["n_grads"] < out[1]["n_params"]  # TP rank 1 leaves the replicated (norm) weights out
