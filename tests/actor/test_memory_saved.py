"""memory.layer_saved_elements against what autograd really keeps: one decoder layer of megatron-core's
GPTModel in bf16 on CPU (Qwen2 with GQA, Qwen3 with q/k norms), for the sdpa and the dense local backends,
with and without selective recompute. The CPU runs torch's composite RMSNorm, so the accounting is taken with
cuda_kernels=False; every other tensor (megatron's fused SwiGLU included) is the one the GPU keeps."""
import pytest

import memory_worker as mw
from m2po_megatron.actor.launch import run_multiprocess
from m2po_megatron.models.memory import layer_saved_elements, model_shape

CASES = [(m, b, "bf16", r) for m in ("qwen2", "qwen3") for b in ("sdpa", "local") for r in (None, "selective")]
ROW = 512


@pytest.mark.timeout(300)
def test_layer_accounting_equals_the_saved_tensors():
    measured = run_multiprocess(mw.saved_bytes_per_token, 1, args=(CASES, ROW), timeout=280)[0]
    for (model_type, backend, _, recompute), got in zip(CASES, measured):
        act, fp8, f32 = layer_saved_elements(model_shape(mw.hf_config(model_type)), attention_backend=backend,
                                             row_tokens=ROW, recompute=recompute, cuda_kernels=False)
        assert fp8 == 0
        case = (model_type, backend, recompute, got)
        assert got.get("bfloat16", 0.0) == pytest.approx(2 * act, rel=1e-9), case
        assert got.get("float32", 0.0) == pytest.approx(4 * f32, rel=1e-9), case
        if backend == "local" and recompute is None:  # the S x S scores dominate the dense path
            assert act > 2 * layer_saved_elements(model_shape(mw.hf_config(model_type)), row_tokens=ROW,
                                                  cuda_kernels=False)[0]
