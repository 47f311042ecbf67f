"""Precision/FP8 requests are checked before any model is built (pure function, machine facts passed in)."""
import pytest

from m2po_megatron.actor.precision import resolve_precision


def test_cpu_is_fp32_only_and_fp8_needs_gpu_and_te():
    assert resolve_precision("fp32", None, None, cuda=False, te_available=False).params_dtype == "fp32"
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        resolve_precision("bf16", None, None, cuda=False, te_available=False)
    with pytest.raises(ValueError, match="no GPU"):
        resolve_precision("fp32", "e4m3", None, cuda=False, te_available=False)
    with pytest.raises(ValueError, match="Transformer Engine"):
        resolve_precision("bf16", "hybrid", "delayed", cuda=True, te_available=False, compute_capability=(9, 0))
    with pytest.raises(ValueError, match="compute capability"):
        resolve_precision("bf16", "e4m3", "mxfp8", cuda=True, te_available=True, compute_capability=(9, 0))
    with pytest.raises(ValueError, match="fp8_recipe"):
        resolve_precision("bf16", "e4m3", "nope", cuda=True, te_available=True, compute_capability=(9, 0))
    p = resolve_precision("bf16", "e4m3", "blockwise", cuda=True, te_available=True, compute_capability=(9, 0))
    assert (p.fp8, p.fp8_recipe) == ("e4m3", "blockwise")


def test_actor_rejects_bad_settings_before_distributed_work():
    from m2po_megatron.actor.actor import MegatronActor

    import actor_workers as w

    cfg = w.tiny_config("qwen2_untied")
    for kw, msg in [(dict(params_dtype="bf16"), "CUDA GPU"), (dict(fp8="e4m3"), "GPU"),
                    (dict(context_parallel_size=2), "not supported yet"),
                    (dict(optimizer="sgd"), "use_distributed_optimizer=False"),
                    (dict(lr_schedule="cosine"), "lr_decay_steps"),
                    (dict(tensor_model_parallel_size=3), "divisible")]:
        with pytest.raises((ValueError, NotImplementedError), match=msg):
            MegatronActor(hf_config=cfg, micro_batch_tokens=64, **kw)
