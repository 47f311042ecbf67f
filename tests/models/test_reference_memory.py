"""The reference model (algo.use_kl_loss) in the memory estimate: models/reference_memory.py's terms, both
phases, both places of its weights (algo.ref_param_offload), and `m2po config`'s named line. Pure arithmetic."""
from __future__ import annotations

import pytest

from m2po_megatron.config import estimate_memory, load_config
from m2po_megatron.models.memory import GiB, ModelShape, estimate_gpu_memory, format_estimate
from m2po_megatron.models.reference_memory import LOGPROB_CHUNK_BYTES, forward_only_bytes

Q17 = "recipes/paper/qwen3-1.7b-base.yaml"
# a dense shape whose forward-only pass is worked out by hand below
S = ModelShape(hidden=1024, layers=4, heads=8, kv_heads=4, head_dim=128, ffn=4096, vocab=32768, tied=False,
               qkv_bias=False, qk_norm=False)


def _recipe(*overrides: str) -> dict:
    return estimate_memory(load_config(Q17, list(overrides), check_files=False))


def test_off_leaves_the_estimate_as_it_was():
    base = _recipe()
    assert _recipe("algo.use_kl_loss=false", "algo.ref_param_offload=false") == base
    assert "reference" not in base and "reference model" not in format_estimate(base)


def test_offloaded_reference_is_a_phase_of_its_own():
    base, est = _recipe(), _recipe("algo.use_kl_loss=true")
    static = base["weights"] + base["grads"] + base["optimizer"] + base["overhead"]
    assert est["reference"] == base["weights"]  # the same parameters on this rank, in the same dtype
    assert est["reference_on_gpu"] == 0.0
    assert est["training"] == pytest.approx(base["total"])  # the training phase does not hold it
    assert est["reference_pass"] == pytest.approx(static + est["reference"] + est["reference_activations"])
    assert est["total"] == max(est["training"], est["reference_pass"]) == pytest.approx(base["total"])
    # Qwen3-1.7B at TP2 x SP, 16,384-token micro-batches: the pass's activations are under 1 GiB
    assert 0.3 < est["reference_activations"] < 1.0
    line = format_estimate(est)
    assert "reference model: weights 1.6 (on the host outside its pass)" in line and "(peak: training)" in line


def test_resident_reference_is_in_every_phase():
    base, est = _recipe(), _recipe("algo.use_kl_loss=true", "algo.ref_param_offload=false")
    assert est["reference_on_gpu"] == est["reference"] == base["weights"]
    assert est["total"] == pytest.approx(base["total"] + base["weights"])
    assert est["reference_pass"] < est["training"]
    assert "(resident)" in format_estimate(est) and format_estimate(est).endswith(f"total {est['total']:.1f} GiB")


def test_the_reference_pass_is_the_peak_when_training_is_light():
    """Full recompute at short micro-batches and DP 8: training keeps a layer input a token and Adam's step
    temporary is a sharded 0.5 byte a parameter, while the reference pass holds a second copy of the weights
    (2 bytes a parameter); that phase is then the peak, and the total."""
    est = estimate_gpu_memory("m2po_megatron/assets/configs/Qwen__Qwen3-8B-Base/config.json",
                              micro_batch_tokens=512, recompute="full", data_parallel_size=8, reference_model=True)
    assert est["reference_pass"] > est["training"] and est["total"] == est["reference_pass"]
    assert "(peak: reference pass)" in format_estimate(est)


def test_forward_only_bytes_by_hand():
    t, a = 4096, 2
    # no tensor or sequence parallelism, CUDA kernels, not the last stage: the residual stream plus the larger
    # of attention (norm out, qkv, q and k after RoPE, the attention output, the projection) and the MLP
    # (norm out, fc1's 2F and SwiGLU's F)
    attn = a * (1024 + (1024 + 2 * 512) + (1024 + 512) + 1024 + 1024)
    mlp = a * (1024 + 3 * 4096)
    assert max(attn, mlp) == mlp
    # the stage's input: the embedding's output and its copy on the first stage, the received activations else
    assert forward_only_bytes(S, t, last=False) == t * (2 * a * 1024 + a * 1024 + mlp)
    assert forward_only_bytes(S, t, first=False, last=False) == t * (a * 1024 + a * 1024 + mlp)
    # the last stage: one chunk of fp32 logit rows and its exp beside the final hidden states and the response
    # rows: rows = CHUNK_BYTES / (4 V) = 2048, 2048 x 32768 x 8 bytes = 512 MiB over 4096 tokens
    rows = LOGPROB_CHUNK_BYTES // (4 * 32768)
    head = a * (1024 + 1024) + 16 + rows * 32768 * 8 / t
    assert forward_only_bytes(S, t, first=False) == t * (2 * a * 1024 + head)
    # TP2 with sequence parallelism: the residual stream is split, the norm's output gathered
    tp = forward_only_bytes(S, t, tp=2, sequence_parallel=True, first=False, last=False)
    assert tp == t * (2 * a * 512 + a * (512 + 1024) + a * 3 * 2048)
    # the CPU's kernels (what m2po rehearse traces): the eager SwiGLU keeps silu's output beside the product
    cpu = forward_only_bytes(S, t, first=False, last=False, cuda_kernels=False)
    assert cpu - forward_only_bytes(S, t, first=False, last=False) == t * a * 4096


def test_the_estimate_keeps_the_fused_ops_chunk_size():
    """models/ may not import actor/: the copy of the fused op's chunk size must stay equal to it."""
    from m2po_megatron.actor import fused_logprobs

    assert LOGPROB_CHUNK_BYTES == fused_logprobs.CHUNK_BYTES


def test_every_stage_and_moe_take_the_reference():
    est = estimate_gpu_memory("m2po_megatron/assets/configs/Qwen__Qwen3-30B-A3B-Base/config.json",
                              micro_batch_tokens=8192, tensor_model_parallel_size=2, pipeline_model_parallel_size=8,
                              sequence_parallel=True, reference_model=True, pipeline_stage=0)
    assert est["reference"] == est["weights"] and est["reference_activations"] * GiB > 0
