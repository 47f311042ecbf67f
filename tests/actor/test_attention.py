"""The sdpa attention backend (PyTorch's fused attention per packed sequence) against HF transformers, against
megatron's dense-mask path and against a float64 reference, in forward and gradients (CPU, fp32)."""
import pytest

import actor_workers as w
from m2po_megatron.actor.launch import run_multiprocess


@pytest.mark.timeout(400)
def test_sdpa_backend_matches_hf_and_the_dense_path():
    names = ["qwen2_untied", *w.BUNDLED]
    out = run_multiprocess(w.attention_worker, 1, args=(names,), timeout=380)[0]
    for name, r in out.items():
        assert r["hf_logits"] <= 1e-5, (name, r)
        assert r["dense_logits"] <= 1e-5, (name, r)
        # gradients of O(1..10) entries: agree to fp32 rounding
        assert r["grad_scale"] > 1e-2 and r["num_checked"] >= 4, (name, r)
        assert r["hf_grads"] <= 1e-5 * max(1.0, r["grad_scale"]), (name, r)
        assert r["dense_grads"] <= 1e-5 * max(1.0, r["grad_scale"]), (name, r)


@pytest.mark.timeout(200)
def test_packed_sdpa_module_matches_a_float64_reference():
    r = run_multiprocess(w.attention_module_worker, 1, timeout=180)[0]
    assert r["thd_out"] <= 1e-5 and r["thd_grad"] <= 1e-5, r
    assert r["sbhd_masked_out"] <= 1e-5 and r["sbhd_causal_out"] <= 1e-6, r
