"""HF config parsing and validation (pure, no Megatron process state)."""
import pytest

from m2po_megatron.models import UnsupportedModelError, read_hf_config
from m2po_megatron.models.weights import expected_hf_names, megatron_names, rule_for, to_hf, to_megatron_shard
from tiny import CONFIGS, INLINE_QWEN2, tiny_config


def test_qwen2_inline():
    s = read_hf_config(INLINE_QWEN2)
    assert (s.family, s.qkv_bias, s.qk_norm, s.head_dim, s.tie_word_embeddings) == ("qwen2", True, False, 16, False)


def test_unsupported_architecture_lists_supported():
    with pytest.raises(UnsupportedModelError, match=r"MistralForCausalLM.*supported: Qwen2"):
        read_hf_config({**INLINE_QWEN2, "architectures": ["MistralForCausalLM"], "model_type": "mistral"})


def test_unsupported_rope_type():
    cfg = {**INLINE_QWEN2, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(UnsupportedModelError, match="yarn"):
        read_hf_config(cfg)


def test_transformers5_rope_parameters():
    cfg = dict(INLINE_QWEN2)
    cfg.pop("rope_theta")
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 12345.0}
    assert read_hf_config(cfg).rope_theta == 12345.0


def test_from_pretrained_config_object():
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(CONFIGS / "meta-llama__Llama-3.2-3B-Instruct")
    s = read_hf_config(cfg)
    assert s.rope_theta == 500000.0 and s.rope_scaling["factor"] == 32.0 and s.head_dim == 128
    assert s.tie_word_embeddings and s.num_key_value_heads == 8


def test_qwen3_head_dim():
    s = read_hf_config(tiny_config("qwen3"))
    assert s.qk_norm and s.head_dim == 32 and s.head_dim * s.num_attention_heads != s.hidden_size


@pytest.mark.parametrize("tp", [1, 2])
def test_table_round_trip_pure(tp):
    """Sharding HF tensors per rank and gathering them back gives the same tensors (every rule kind)."""
    import torch

    s = read_hf_config(INLINE_QWEN2)
    shapes = {n: None for n in expected_hf_names(s)}
    from m2po_megatron.models.weights import expected_hf_shapes

    g = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(sh, generator=g) for n, sh in expected_hf_shapes(s).items()}
    assert set(hf) == set(shapes)
    for name in megatron_names(s):
        rule, layer = rule_for(s, name)
        ins = [hf[n.format(i=layer)] for n in rule.hf]
        shards = [to_megatron_shard(s, rule, ins, r, tp) for r in range(tp)]
        if rule.kind == "replicated":
            shards = shards[:1]
        for n, t in to_hf(s, rule, shards, layer):
            assert torch.equal(t, hf[n]), n


def test_fp8_needs_transformer_engine_and_gpu():
    from m2po_megatron.models import te_available, validate_fp8

    validate_fp8(None, None)
    with pytest.raises(ValueError, match="fp8_recipe"):
        validate_fp8("e4m3", "nope")
    with pytest.raises(ValueError, match="fp8='e5m2'"):
        validate_fp8("e5m2", None)
    if not te_available():
        with pytest.raises(ValueError, match="Transformer Engine"):
            validate_fp8("hybrid", "delayed")


def test_world_size_not_divisible_names_both_numbers():
    from m2po_megatron.actor.parallel import check_parallel_sizes

    assert check_parallel_sizes(8, 2, 2) == 2
    with pytest.raises(ValueError, match=r"world size 6 .* = 4"):
        check_parallel_sizes(6, 2, 2)


def test_layout_validation():
    from m2po_megatron.models import validate_layout

    s = read_hf_config(INLINE_QWEN2)
    with pytest.raises(ValueError, match="num_key_value_heads = 2 .* not divisible by tensor_model_parallel_size = 4"):
        validate_layout(s, 4, 1)
    with pytest.raises(ValueError, match="num_hidden_layers = 2"):
        validate_layout(s, 1, 4)
