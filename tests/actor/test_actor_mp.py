"""Megatron actor on CPU/gloo in several processes, against HF transformers and against itself at TP1."""
import math

import pytest

import actor_workers as w
from m2po_megatron.actor.launch import run_multiprocess


@pytest.mark.timeout(400)
def test_log_probs_match_hf_tp1_dp2_tp2_pp2():
    """fp32 log-probs (and entropy) equal transformers' at DP2 (TP1), TP2 and PP2, for the inline untied
    Qwen2 and tied Qwen2, Qwen3 and Llama-3.2 shrunk from the bundled configs."""
    names = ["qwen2_untied", *w.BUNDLED]
    out = run_multiprocess(w.logprob_worker, 2, args=(names, [(1, 1), (2, 1), (1, 2)]), timeout=380)
    for rank_out in out:
        for (name, tp, pp), (d_lp, d_ent, dp) in rank_out.items():
            assert d_lp <= 1e-5, f"{name} tp{tp} pp{pp}: max |log-prob diff| {d_lp}"
            assert d_ent <= 1e-4, f"{name} tp{tp} pp{pp}: max |entropy diff| {d_ent}"
            assert dp == 2 // (tp * pp)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_log_probs_match_hf_tp2_pp2():
    out = run_multiprocess(w.logprob_worker, 4, args=(["qwen2_untied"], [(2, 2)]), timeout=580)
    for rank_out in out:
        for key, (d_lp, _, _) in rank_out.items():
            assert d_lp <= 1e-5, f"{key}: {d_lp}"


@pytest.mark.timeout(300)
def test_m2_tokens_bounds_the_second_moment_of_the_trust_region_or_of_every_valid_token():
    out = run_multiprocess(w.m2_tokens_worker, 1, timeout=280)[0]
    for tokens in ("trust_region", "all"):
        global_m2, loss_m2, dropped = out[tokens]
        assert global_m2 == pytest.approx(out["hf"][tokens], rel=1e-4), tokens  # M2 over the chosen tokens
        assert loss_m2 == pytest.approx(global_m2, rel=1e-6), tokens  # the loss reports the same set
        assert dropped > 0, tokens
    assert out["hf"]["all"] != pytest.approx(out["hf"]["trust_region"], rel=1e-3)  # the two sets differ here


@pytest.mark.timeout(600)
def test_short_minibatches_at_dp4_update_as_dp1_does():
    """Mini-batches of 0, 1, 3 and 5 sequences at DP = 4 (issue 35): a rank without a sequence joins every
    collective with a zero-weight filler; each update and its metrics equal DP = 1's (the global
    denominators); a mini-batch of no sequence is no update on any rank."""
    dp4 = run_multiprocess(w.short_batch_worker, 4, timeout=560)
    dp1 = run_multiprocess(w.short_batch_worker, 1, timeout=300)[0]
    for name, (dp, ref_rows) in dp1.items():
        assert dp == 1
        for rank in range(4):
            size, rows = dp4[rank][name]
            assert size == 4
            for n, ((m, wts), (m1, w1)) in zip((0, 1, 3, 5), zip(rows, ref_rows)):
                where = f"{name}, {n} sequences, rank {rank}"
                assert m["num_updates"] == (1 if n else 0) == m1["num_updates"], where
                assert m.get("skipped_empty", 0) == (0 if n else 1), where
                assert (m["num_seqs"], m["num_tokens"]) == (m1["num_seqs"], m1["num_tokens"]), where
                if n:
                    assert m["count/tokens"] == m1["count/tokens"] == m["num_tokens"], where  # no filler token
                    if n <= 4:  # one sequence per rank with one, summed over ranks; fillers not counted
                        assert m["num_microbatches"] == n, where
                    for k in ("loss", "grad_norm", "entropy", "kl/k3", "clip_frac", "m2po/masked_frac"):
                        assert m[k] == pytest.approx(m1[k], rel=1e-4, abs=1e-6), (where, k)
                for k, v in w1.items():
                    assert (wts[k] - v).abs().max() <= 2e-5, (where, k)
            moved = [max(float((a[1][k] - b[1][k]).abs().max()) for k in a[1]) for a, b in zip(rows, [rows[0]] + rows)]
            assert moved[0] == 0.0 and all(x > 0 for x in moved[1:]), (name, moved)  # 0 sequences: no update


@pytest.mark.timeout(700)
def test_train_step_layouts_match_tp1_and_checkpoint_reshards(tmp_path):
    """Two M2PO updates (global batch-level mask, SGD so weights expose the gradients) at TP2 (with and without
    sequence parallelism: the norms' grads are summed over the TP ranks' halves of the rows), PP2 and DP2
    with micro-batching (token budget 40) give the weights of TP1 on whole mini-batches; an Adam checkpoint
    saved at TP2 and loaded at TP1 gives the same next-step loss and update; so does a distributed-optimizer
    (DP2) checkpoint loaded at DP2 and at DP1 (Adam's moments and step restored)."""
    ck, dck = str(tmp_path / "ckpt"), str(tmp_path / "distopt")
    jobs2 = [dict(tp=2, pp=1, num_minibatches=2), dict(tp=2, pp=1, num_minibatches=2, sp=True),
             dict(tp=1, pp=2, num_minibatches=2), dict(tp=1, pp=1, num_minibatches=2),
             dict(tp=2, pp=1, optimizer="adam", distopt=False, save=ck),
             dict(tp=1, pp=1, optimizer="adam", distopt=True, save=dck),
             dict(tp=1, pp=1, optimizer="adam", distopt=True, load=dck)]
    r2 = run_multiprocess(w.train_worker, 2, args=("qwen2_untied", jobs2), timeout=380)
    jobs1 = [dict(tp=1, pp=1, num_minibatches=2, mbt=1000),
             dict(tp=1, pp=1, optimizer="adam", distopt=False, load=ck),
             dict(tp=1, pp=1, optimizer="adam", distopt=True, load=dck),
             dict(tp=1, pp=1, optimizer="adam", distopt=False, load=dck, expect_error=True)]
    r1 = run_multiprocess(w.train_worker, 1, args=("qwen2_untied", jobs1), timeout=240)[0]
    ref = r1[0]
    init = ref["weights"]  # sanity: the step changed the weights and the mask dropped tokens
    assert ref["moved"] > 1e-3  # the updates changed the weights
    assert ref["metrics"]["num_updates"] == 2 and ref["metrics"]["m2po_global/num_dropped"] > 0
    assert ref["metrics"]["num_microbatches"] == 2  # one per mini-batch at a budget of 1000 tokens
    for rank in range(2):
        for job, res in zip(jobs2[:4], r2[rank][:4]):
            m = res["metrics"]
            assert m["num_microbatches"] > 2, job  # really micro-batched
            assert m["m2po_global/num_dropped"] == ref["metrics"]["m2po_global/num_dropped"], job
            assert abs(m["grad_norm"] - ref["metrics"]["grad_norm"]) <= 1e-5, job
            assert abs(m["loss"] - ref["metrics"]["loss"]) <= 1e-6, job
            assert set(res["weights"]) == set(init)
            diff = max(float((res["weights"][k] - init[k]).abs().max()) for k in init)
            assert diff <= 1e-6, (job, diff)
        assert r2[rank][3]["dp"] == 2
    assert abs(r2[0][4]["loss_b"] - r1[1]["loss_b"]) <= 1e-6

    def update_diff(a, b):
        return max(float((a["weights_b"][k] - b["weights_b"][k]).abs().max()) for k in a["weights_b"])

    assert update_diff(r2[0][4], r1[1]) <= 1e-6
    saved = r2[0][5]
    # exact at the same layout (a shared Adam 'step' tensor after loading once made this 3.5e-4)
    assert saved["loss_b"] == r2[0][6]["loss_b"] and update_diff(saved, r2[0][6]) == 0.0  # DP2 -> DP2
    assert abs(saved["loss_b"] - r1[2]["loss_b"]) <= 1e-6 and update_diff(saved, r1[2]) <= 1e-6  # DP2 -> DP1
    assert "set parallel.use_distributed_optimizer=true" in r1[3]["error"]


@pytest.mark.timeout(240)
def test_distributed_adamw_resume_equals_uninterrupted_run(tmp_path):
    """Distributed optimizer (DP2) over torch's AdamW (megatron's optimizer without TE/Apex, on any device):
    save after one update, load into a fresh actor, and the next two updates are bit-identical to the
    uninterrupted run, with torch's foreach kernel (its CUDA default; the per-parameter kernel, its CPU default,
    is checked the same way at DP2 by the layout test above); every parameter holds its own 'step' tensor at 3.
    (megatron 0.19.2 alone: KeyError 'step' on load, and past that one 'step' tensor shared by all parameters,
    incremented once per parameter.)"""
    out = run_multiprocess(w.resume_worker, 2, args=(str(tmp_path), (True,)), timeout=220)
    for rank, res in enumerate(out):
        for foreach, r in res.items():
            assert r["dp"] == 2 and r["updates_b"] == 3
            n = r["steps_a"][2]
            assert r["steps_a"] == ([3.0], n, n), (rank, foreach, r["steps_a"])
            assert r["steps_b"] == ([3.0], n, n), (rank, foreach, r["steps_b"])
            for i, (pa, pb) in enumerate(zip(r["a"], r["b"])):
                diff = max(float((x - y).abs().max()) for x, y in zip(pa, pb))
                assert diff == 0.0, (rank, foreach, f"update {i + 2}", diff)
            moved = max(float((x - y).abs().max()) for x, y in zip(r["a"][0], r["a"][1]))
            assert moved > 1e-4  # the updates after the resume change the weights


@pytest.mark.timeout(300)
def test_activation_recompute_gives_the_same_step():
    """Megatron's selective and full (uniform, block) recompute re-run attention / whole layers in backward
    (counted by forward hooks) and give bit-identical weights after an update."""
    settings = {"none": {}, "selective": {"recompute_granularity": "selective"},
                "uniform": {"recompute_granularity": "full", "recompute_method": "uniform"},
                "block": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}}
    out = run_multiprocess(w.recompute_worker, 1, args=(settings,), timeout=280)[0]
    ref = out["none"]
    L, m = 2, ref["microbatches"]
    # without recompute: the no-grad forward of the global mask, then the training forward
    assert m >= 2 and ref["calls"] == {"layer": 2 * L * m, "core_attn": 2 * L * m}
    # backward re-runs core attention / every layer / the first layer of the stage, once per micro-batch
    assert out["selective"]["calls"] == {"layer": 2 * L * m, "core_attn": 3 * L * m}
    assert out["uniform"]["calls"] == {"layer": 3 * L * m, "core_attn": 3 * L * m}
    assert out["block"]["calls"] == {"layer": (2 * L + 1) * m, "core_attn": (2 * L + 1) * m}
    for name in ("selective", "uniform", "block"):
        assert out[name]["loss"] == ref["loss"], name
        diff = max(float((out[name]["weights"][k] - v).abs().max()) for k, v in ref["weights"].items())
        assert diff == 0.0, (name, diff)


@pytest.mark.timeout(400)
def test_rollout_correction_three_policy_step():
    out = run_multiprocess(w.correction_worker, 1, timeout=380)[0]
    (mb, wb), (mt, wt) = out["same"]["bypass"], out["same"]["tis"]
    assert mt["loss"] == pytest.approx(mb["loss"], abs=1e-7) and mt["grad_norm"] == pytest.approx(mb["grad_norm"])
    assert mt["m2po_global/num_dropped"] == mb["m2po_global/num_dropped"]
    assert max(float((wt[k] - wb[k]).abs().max()) for k in wb) <= 1e-6
    assert mt["rollout_corr/kl_k1"] == 0 and mt["rollout_corr/ratio_p50"] == 1
    assert mt["rollout_corr/weight_mean"] == 1 and mt["rollout_corr/truncated_frac"] == 0
    assert "rollout_corr/kl_k1" not in mb  # bypass makes no proximal pass
    below, above = out["below"], out["above"]
    assert below["tis"]["loss"] == pytest.approx(below["bypass"]["loss"], rel=1e-5)
    assert below["tis"]["rollout_corr/weight_mean"] == pytest.approx(1.5, rel=1e-5)
    assert above["tis"]["loss"] == pytest.approx(above["bypass"]["loss"] * 2.0 / 3.0, rel=1e-5)
    assert above["tis"]["rollout_corr/truncated_frac"] == 1
    mis, expected, d_mean, d_m2 = out["mis"]
    assert 0 < expected < 1 and mis["rollout_corr/masked_frac"] == pytest.approx(expected, abs=1e-9)
    assert mis["per_update"][0]["loss"] == pytest.approx(out["mis_first_loss"], rel=1e-4)  # kept tokens' mean
    # ratio_parts/*: log(theta/engine) = drift log(theta/proximal) + mismatch log(proximal/engine), per update
    assert "ratio_parts/drift_m2" not in mb
    first, second = mt["per_update"]
    assert first["ratio_parts/mismatch_m2"] == 0 and second["ratio_parts/mismatch_m2"] == 0
    assert first["ratio_parts/drift_m2"] < 1e-12 < second["ratio_parts/drift_m2"]  # the first update moved theta
    assert second["ratio_parts/total_m2"] == pytest.approx(second["ratio_parts/drift_m2"], rel=1e-12)
    assert mt["ratio_parts/count_tokens"] == mt["num_tokens"]
    b = below["tis"]
    assert b["ratio_parts/mismatch_mean"] == pytest.approx(math.log(1.5), rel=1e-5)
    assert b["ratio_parts/mismatch_m2"] == pytest.approx(math.log(1.5) ** 2, rel=1e-5)
    assert b["ratio_parts/drift_m2"] < 1e-12
    for u in mis["per_update"]:  # each update sees half the tokens; together they are the whole batch
        assert u["ratio_parts/total_m2"] == pytest.approx(
            u["ratio_parts/drift_m2"] + u["ratio_parts/mismatch_m2"] + 2 * u["ratio_parts/cross"], rel=1e-9)
    n = [u["ratio_parts/count_tokens"] for u in mis["per_update"]]
    pooled_m2 = sum(c * u["ratio_parts/mismatch_m2"] for c, u in zip(n, mis["per_update"])) / sum(n)
    pooled_mean = sum(c * u["ratio_parts/mismatch_mean"] for c, u in zip(n, mis["per_update"])) / sum(n)
    assert pooled_m2 == pytest.approx(d_m2, rel=1e-5) and pooled_mean == pytest.approx(d_mean, rel=1e-4, abs=1e-7)
