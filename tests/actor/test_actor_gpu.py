"""GPU checks (skipped without CUDA; run by benchmarks/gpu_check.py's gpu_tests part): bf16 log-prob and
gradient parity with HF, resume equal to an uninterrupted run, and peak memory within the memory estimate's
margin at the recipes' 16,384-token rows, for the attention backends this machine has (sdpa always; te and
FP8 where Transformer Engine is importable). Throughput is reported by the benchmark, never asserted here.
The workers (gpu_workers.py) also run at toy size on CPU (test_gpu_workers_run_at_toy_size_on_cpu)."""
import importlib.util
import math

import pytest

import actor_workers as w
import gpu_workers as gw
from m2po_megatron.actor.launch import run_multiprocess

HAS_TE = importlib.util.find_spec("transformer_engine") is not None
NEEDS_TE = pytest.mark.skipif(not HAS_TE, reason="Transformer Engine absent")
BACKENDS = ["sdpa", pytest.param("te", marks=NEEDS_TE)]


def _parity_worker(backend, toy=False):
    import torch

    from m2po_megatron.actor.actor import MegatronActor

    dev, precision = gw.device_and_precision()
    cfg = gw.qwen3(4, toy, tie_word_embeddings=False)
    hf = w.make_hf_model(cfg).to(dev)
    batch = w.make_batch(n=6, vocab=cfg["vocab_size"], min_len=64, max_len=512)
    ref, _ = w.hf_log_probs(hf, batch)
    actor = MegatronActor(hf_config=cfg, load_from=hf, params_dtype=precision, micro_batch_tokens=1024,
                          attention_backend=backend, loss_name="grpo")
    lp, _ = actor.compute_log_probs(batch)
    actor.close()
    hf16, _ = w.hf_log_probs(hf.to(torch.bfloat16), batch)
    d_actor = torch.cat([(a - b).abs() for a, b in zip(lp, ref)])
    d_hf = torch.cat([(a - b).abs() for a, b in zip(hf16, ref)])
    return {"actor_max": float(d_actor.max()), "actor_mean": float(d_actor.mean()),
            "hf_max": float(d_hf.max()), "hf_mean": float(d_hf.mean()),
            "actor_l2": float(d_actor.norm()), "hf_l2": float(d_hf.norm()),
            "ref_l2": float(torch.cat(ref).norm())}


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_no_worse_than_hf_bf16(backend):
    """||g_actor(bf16) - g_HF(fp32)|| <= 1.5 x ||g_HF(bf16) - g_HF(fp32)|| + 1e-6 ||g_HF(fp32)||, the norms
    over all parameters together (4-layer Qwen3-1.7B, tied embeddings, grpo_notr loss, one step)."""
    r = run_multiprocess(gw.grad_worker, 1, args=(backend,), timeout=280)[0]
    print(backend, r)
    assert r["d_hf_bf16"] > 0 and math.isfinite(r["d_actor"]), r
    assert gw.within_bf16_bound(r["d_actor"], r["d_hf_bf16"], r["ref_norm"]), r


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_next_step_equals_an_uninterrupted_run(backend, tmp_path):
    """Save after two Adam updates, load into an actor with other weights: the loaded weights are the saved
    ones, and the third update's loss and weights match the uninterrupted run's (weights within 5 % of the
    update's size: a wrong Adam step count changes the update by far more)."""
    r = run_multiprocess(gw.resume_worker, 1, args=(backend, str(tmp_path / "ckpt")), timeout=280)[0]
    print(backend, r)
    assert r["fresh_vs_saved"] > 0 and r["loaded_vs_saved_max"] == 0.0, r
    assert r["updates"] == (3, 3), r
    assert r["loss_res"] == pytest.approx(r["loss_cont"], rel=1e-3, abs=1e-6), r
    assert r["update_norm"] > 0 and r["resumed_vs_cont"] <= 0.05 * r["update_norm"], r


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend, fp8", [("sdpa", None), pytest.param("te", None, marks=NEEDS_TE),
                                          pytest.param("te", "e4m3", marks=NEEDS_TE)])
def test_peak_memory_within_the_estimate_at_the_recipe_rows(backend, fp8):
    from m2po_megatron.models.memory import MARGIN

    r = run_multiprocess(gw.peak_worker, 1, args=(backend, fp8), timeout=280)[0]
    print(backend, fp8, {k: (v / 1024**3 if k in ("peak", "estimate") else v) for k, v in r.items()})
    assert r["microbatches"] == 2 and max(r["row_lengths"]) > 14000, r
    if backend == "te":
        assert all(n % 16 for n in r["row_lengths"]), r  # ragged: the actor must pad for TE's FP8 GEMMs
    assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, r
    assert abs(r["peak"] / r["estimate"] - 1) <= MARGIN, r


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_log_probs_no_worse_than_hf_bf16(backend):
    """Against HF in fp32 on the same weights, the actor in bf16 errs at most 1.5x as much as HF itself does
    in bf16, in the mean and in the L2 norm over every response token (the maxima are reported, not
    compared: one noisy token decides them)."""
    r = run_multiprocess(_parity_worker, 1, args=(backend,), timeout=280)[0]
    print(backend, r)
    assert r["hf_mean"] > 0
    assert r["actor_mean"] <= 1.5 * r["hf_mean"], r
    assert gw.within_bf16_bound(r["actor_l2"], r["hf_l2"], r["ref_l2"]), r


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_real_size_log_probs_and_r3_replay(backend):
    """Qwen3-30B-A3B's layer shapes (2 layers, 128 experts, top-8) in bf16: log-probs no worse than 1.5x HF
    bf16's mean error against HF fp32; one R3 update with full recompute dispatches every replayed token to
    its recorded experts, in the forward and in the recompute, with a finite gradient."""
    r = run_multiprocess(gw.moe_worker, 1, args=(backend,), timeout=280)[0]
    print(backend, r)
    _check_moe(r)
    assert r["actor_mean"] <= 1.5 * r["hf_mean"], r


def _check_moe(r):
    for where in ("forward", "recompute"):
        n_target, n_equal = r["exact"][where]
        assert n_target > 0 and n_equal == n_target, (where, r)
    assert r["replayed"][0] == r["replayed"][1] > 0, r
    assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, r


# ------------------------------------------------------------------------------------------------ CPU
def _toy_all(tmp):
    """Every worker above at toy size, in one process (one spawn)."""
    return {"parity": _parity_worker("sdpa", True), "grad": gw.grad_worker("sdpa", True),
            "resume": gw.resume_worker("sdpa", tmp, True), "peak": gw.peak_worker("sdpa", None, True),
            "moe": gw.moe_worker("sdpa", True)}


@pytest.mark.timeout(400)
def test_gpu_workers_run_at_toy_size_on_cpu(tmp_path):
    """The workers at toy size in fp32 on CPU: they run, and where fp32 makes the answer exact, it is: the
    actor's log-probs and gradients equal HF fp32's, the resumed step equals the uninterrupted one."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the GPU runs the real sizes")
    r = run_multiprocess(_toy_all, 1, args=(str(tmp_path / "ckpt"),), timeout=380)[0]
    p, g, s, k = r["parity"], r["grad"], r["resume"], r["peak"]
    assert p["actor_max"] <= 1e-4 and p["hf_mean"] > p["actor_mean"], p
    # fp32 actor gradients (main_grad, mapped to HF names) equal HF fp32's; HF bf16 is far off
    assert g["d_actor"] <= 1e-4 * g["ref_norm"] < g["d_hf_bf16"], g
    assert gw.within_bf16_bound(g["d_actor"], g["d_hf_bf16"], g["ref_norm"]), g
    assert g["loss_actor"] == pytest.approx(g["loss_ref"], rel=1e-5, abs=1e-7), g
    assert s["fresh_vs_saved"] > 0 and s["loaded_vs_saved_max"] == 0.0 and s["updates"] == (3, 3), s
    assert s["loss_res"] == pytest.approx(s["loss_cont"], rel=1e-6) and s["update_norm"] > 0, s
    assert s["resumed_vs_cont"] <= 1e-4 * s["update_norm"], s
    assert k["microbatches"] == 2 and math.isfinite(k["loss"]) and k["grad_norm"] > 0, k
    _check_moe(r["moe"])
    assert r["moe"]["actor_max"] <= 1e-4, r["moe"]  # fp32: the MoE actor's log-probs are HF's


def test_gradient_bound_is_a_norm_over_all_parameters():
    """The bound compares whole-model error norms: an actor whose largest error is smaller than HF bf16's but
    whose errors are spread over many parameters fails it; names must match."""
    import torch

    ref = {"a": torch.ones(100), "b": torch.ones(100)}
    hf16 = {"a": ref["a"] + torch.cat([torch.tensor([1.0]), torch.zeros(99)]), "b": ref["b"].clone()}
    spread = {"a": ref["a"] + 0.5, "b": ref["b"] + 0.5}  # max error 0.5 < 1.0, norm sqrt(50) > 1
    d16, ds = gw.diff_norm(hf16, ref), gw.diff_norm(spread, ref)
    assert d16 == pytest.approx(1.0) and ds == pytest.approx(math.sqrt(50.0))
    assert not gw.within_bf16_bound(ds, d16, gw.norm(ref))
    assert gw.within_bf16_bound(1.4, d16, gw.norm(ref)) and not gw.within_bf16_bound(1.6, d16, gw.norm(ref))
    assert gw.within_bf16_bound(0.0, 0.0, gw.norm(ref))  # exact fp32 runs pass through rel_eps
    with pytest.raises(ValueError, match="parameter names differ"):
        gw.diff_norm({"a": ref["a"]}, ref)
