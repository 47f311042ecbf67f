"""m2po_megatron.models.memory: parameter counts of the six paper models and the per-GPU memory estimate."""
from __future__ import annotations

from pathlib import Path

import pytest

from m2po_megatron.models.hf_config import load_hf_config_dict
from m2po_megatron.models.memory import LOGPROB_CHUNK_BYTES, estimate_gpu_memory, model_shape, param_count

CONFIGS = Path(__file__).resolve().parents[1] / "m2po_megatron" / "assets" / "configs"
# published sizes (billions), two decimals
PUBLISHED = {
    "meta-llama__Llama-3.2-3B-Instruct": 3.21,
    "Qwen__Qwen2.5-Math-7B": 7.62,
    "Qwen__Qwen3-1.7B-Base": 1.72,
    "Qwen__Qwen3-4B-Base": 4.02,
    "Qwen__Qwen3-8B-Base": 8.19,
    "Qwen__Qwen2.5-32B": 32.76,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_count_matches_the_published_size(name):
    assert round(param_count(load_hf_config_dict(CONFIGS / name)) / 1e9, 2) == PUBLISHED[name]


def test_bundled_configs_equal_the_shared_copies(shared_dir):
    for name in PUBLISHED:
        assert load_hf_config_dict(CONFIGS / name) == load_hf_config_dict(shared_dir / "data" / "configs" / name)


def test_shape_reads_qwen2_bias_and_qwen3_qk_norm():
    q2 = model_shape(load_hf_config_dict(CONFIGS / "Qwen__Qwen2.5-32B"))
    q3 = model_shape(load_hf_config_dict(CONFIGS / "Qwen__Qwen3-8B-Base"))
    llama = model_shape(load_hf_config_dict(CONFIGS / "meta-llama__Llama-3.2-3B-Instruct"))
    assert (q2.qkv_bias, q2.qk_norm, q2.head_dim) == (True, False, 128)
    assert (q3.qkv_bias, q3.qk_norm, q3.head_dim) == (False, True, 128)
    assert (llama.qkv_bias, llama.tied, llama.kv_heads) == (False, True, 8)


def _est(name, **kw):
    return estimate_gpu_memory(load_hf_config_dict(CONFIGS / name), **kw)


def test_no_parallelism_is_the_textbook_18_bytes_per_param():
    cfg = load_hf_config_dict(CONFIGS / "Qwen__Qwen3-1.7B-Base")
    e = estimate_gpu_memory(cfg, micro_batch_tokens=1, use_distributed_optimizer=False)
    n = param_count(cfg)
    assert (e["weights"] + e["grads"] + e["optimizer"]) * 1024**3 == pytest.approx(18 * n, rel=1e-9)


def test_parallelism_divides_the_right_components():
    base = _est("Qwen__Qwen3-8B-Base", micro_batch_tokens=8192)
    tp2 = _est("Qwen__Qwen3-8B-Base", tensor_model_parallel_size=2, micro_batch_tokens=8192)
    dp8 = _est("Qwen__Qwen3-8B-Base", data_parallel_size=8, micro_batch_tokens=8192)
    sp = _est("Qwen__Qwen3-8B-Base", tensor_model_parallel_size=2, sequence_parallel=True, micro_batch_tokens=8192)
    # TP splits weights (norms stay replicated: slightly more than half); the fused log-probs' vocabulary-
    # sized parts (the output weight's gradient) split too, and are far below [S, V/tp] logits + gradient
    assert 0.5 < tp2["weights"] / base["weights"] < 0.51
    assert tp2["logits"] < base["logits"]
    assert base["logits"] > LOGPROB_CHUNK_BYTES / 1024**3  # one chunk of fp32 logit rows at least
    row = _est("Qwen__Qwen3-1.7B-Base", micro_batch_tokens=30000)  # the recipes' rows
    assert row["logits"] < 30000 * 151936 * 2 * 2 / 1024**3 / 4  # bf16 [S, V] logits + gradient before
    # the distributed optimizer shards only the optimizer state
    assert dp8["optimizer"] == pytest.approx(base["optimizer"] / 8)
    assert dp8["weights"] == base["weights"] and dp8["grads"] == base["grads"]
    # sequence parallel shards the rest of the activations
    assert sp["activations"] < tp2["activations"] < base["activations"]
    assert base["total"] == pytest.approx(sum(base[k] for k in
                                              ("weights", "grads", "optimizer", "activations", "logits", "overhead")))
    # a micro-batch of one token: the optimizer step's fp32 temporary is the larger transient
    tiny = _est("Qwen__Qwen3-8B-Base", micro_batch_tokens=1)
    assert tiny["optimizer_step"] == pytest.approx(tiny["grads"])
    assert tiny["optimizer_step"] > tiny["activations"] + tiny["logits"]
    assert tiny["total"] == pytest.approx(tiny["weights"] + tiny["grads"] + tiny["optimizer"]
                                          + tiny["optimizer_step"] + tiny["overhead"])


def test_each_attention_backend_as_built():
    """sdpa's flex kernel keeps what TE's fused attention keeps (its output doubles as linear_proj's input);
    the dense local path keeps heads x row fp32 + bf16 scores per token and layer,
    so its activations grow with the square of the row; TE brings its fused Adam (no foreach temporary)."""
    cfg = load_hf_config_dict(CONFIGS / "Qwen__Qwen3-1.7B-Base")
    s = model_shape(cfg)
    est = {b: estimate_gpu_memory(cfg, micro_batch_tokens=4096, attention_backend=b) for b in ("te", "sdpa", "local")}
    assert est["sdpa"]["activations"] == pytest.approx(est["te"]["activations"])
    scores = (est["local"]["activations"] - est["sdpa"]["activations"]) * 1024**3
    assert scores > 4096 * s.layers * s.heads * 4096 * 6 * 0.95  # 6 bytes per score: bf16 probs + fp32 softmax
    double = estimate_gpu_memory(cfg, micro_batch_tokens=8192, attention_backend="local")
    assert double["activations"] > 3.5 * est["local"]["activations"]
    assert est["te"]["optimizer_step"] == 0 < est["sdpa"]["optimizer_step"]
    with pytest.raises(ValueError, match="attention_backend"):
        estimate_gpu_memory(cfg, micro_batch_tokens=4096, attention_backend="flash")


def test_activations_scale_with_tokens_and_shrink_with_recompute_and_fp8():
    a = _est("Qwen__Qwen2.5-Math-7B", micro_batch_tokens=4096)
    b = _est("Qwen__Qwen2.5-Math-7B", micro_batch_tokens=8192)
    assert b["activations"] == pytest.approx(2 * a["activations"])  # linear in the row with fused attention
    full = _est("Qwen__Qwen2.5-Math-7B", micro_batch_tokens=8192, recompute="full")
    assert full["activations"] < b["activations"] / 5
    fp8 = _est("Qwen__Qwen2.5-Math-7B", micro_batch_tokens=8192, fp8=True)
    assert fp8["activations"] < b["activations"] and fp8["weights"] > b["weights"]


def test_pipeline_keeps_pp_microbatches_on_the_first_stage():
    one = _est("Qwen__Qwen2.5-32B", tensor_model_parallel_size=8, pipeline_model_parallel_size=1,
               micro_batch_tokens=4096)
    four = _est("Qwen__Qwen2.5-32B", tensor_model_parallel_size=8, pipeline_model_parallel_size=4,
                micro_batch_tokens=4096)
    assert four["activations"] == pytest.approx(one["activations"])  # L/pp layers x pp micro-batches
    assert four["weights"] < one["weights"] / 3


def test_32b_without_model_parallelism_does_not_fit_80gb_but_tp8_does():
    assert _est("Qwen__Qwen2.5-32B", micro_batch_tokens=4096)["total"] > 80
    fit = _est("Qwen__Qwen2.5-32B", tensor_model_parallel_size=8, pipeline_model_parallel_size=2,
               data_parallel_size=2, micro_batch_tokens=8192, sequence_parallel=True, fp8=True)
    assert fit["total"] < 80


@pytest.mark.parametrize("kw, field", [
    ({"tensor_model_parallel_size": 3}, "tensor_model_parallel_size"),
    ({"pipeline_model_parallel_size": 5}, "pipeline_model_parallel_size"),
    ({"sequence_parallel": True}, "sequence_parallel"),
    ({"recompute": "some"}, "recompute"),
    ({"params_dtype": "int8"}, "params_dtype"),
    ({"data_parallel_size": 0}, "data_parallel_size"),
])
def test_bad_layouts_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        _est("Qwen__Qwen3-8B-Base", micro_batch_tokens=4096, **kw)


def test_missing_config_fields_are_named():
    with pytest.raises(ValueError, match="hidden_size"):
        estimate_gpu_memory({"model_type": "qwen3", "num_hidden_layers": 2}, micro_batch_tokens=4096)
    with pytest.raises(ValueError, match="unsupported architecture"):
        estimate_gpu_memory({"num_hidden_layers": 2}, micro_batch_tokens=4096)


def test_the_estimate_counts_the_model_as_it_is_built():
    """The shape comes from the reader the builder uses: a Qwen2 config that says attention_bias: false still
    gets q/k/v biases (Qwen2's attention always has them), as the built model does."""
    from m2po_megatron.models.hf_config import read_hf_config

    cfg = dict(load_hf_config_dict(CONFIGS / "Qwen__Qwen2.5-32B"), attention_bias=False)
    assert model_shape(cfg).qkv_bias and read_hf_config(cfg).qkv_bias


def test_the_estimate_uses_the_fused_log_prob_ops_own_chunk_sizes():
    """models/ may not import actor/, so the estimate keeps copies of the fused op's chunk constants; they
    must be the op's."""
    from m2po_megatron.actor import fused_logprobs
    from m2po_megatron.models import memory

    assert memory.LOGPROB_CHUNK_BYTES == fused_logprobs.CHUNK_BYTES
    assert memory.LOGPROB_VOCAB_BLOCK == fused_logprobs.VOCAB_BLOCK


def test_pipeline_stages_each_estimated():
    """pipeline_stage: the first stage holds the embedding and PP micro-batches in flight, a middle one neither
    end, the last one the output layer (a tied embedding's copy) with the log-probs and one micro-batch; the
    default stays the worst case of both ends."""
    cfg = load_hf_config_dict(CONFIGS / "Qwen__Qwen2.5-32B")
    kw = dict(micro_batch_tokens=16384, tensor_model_parallel_size=8, pipeline_model_parallel_size=4)
    first, mid, last = (estimate_gpu_memory(cfg, pipeline_stage=s, **kw) for s in (0, 1, 3))
    worst = estimate_gpu_memory(cfg, **kw)
    s = model_shape(cfg)
    emb = s.vocab * s.hidden / 8 / 1e9
    assert first["params_per_gpu_billion"] - mid["params_per_gpu_billion"] == pytest.approx(emb)
    assert last["params_per_gpu_billion"] - mid["params_per_gpu_billion"] == pytest.approx(emb + s.hidden / 1e9)
    assert first["logits"] == mid["logits"] == 0 < last["logits"] == worst["logits"]
    # activations: 4, 3 and 1 micro-batches of the stage's layers in flight (the last adds what is outside them)
    assert first["activations"] / mid["activations"] == pytest.approx(4 / 3)
    assert worst["activations"] >= first["activations"] and worst["total"] >= max(first["total"], last["total"])
    # capped by the micro-batches there are
    one = estimate_gpu_memory(cfg, pipeline_stage=0, microbatches_in_flight=1, **kw)
    assert one["activations"] == pytest.approx(first["activations"] / 4)
    with pytest.raises(ValueError, match="pipeline_stage"):
        estimate_gpu_memory(cfg, pipeline_stage=4, **kw)
