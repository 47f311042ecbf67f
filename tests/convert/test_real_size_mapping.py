"""Checkpoint conversion's HF <-> Megatron mapping at real size (convert/mapping_check.py): every bundled config at
every valid TP in {1, 2, 4, 8} x PP in {1, 2, 4}, on the meta-device models the conversion ranks build, in a fake
process group (one rank at a time, in this process). What the configs bring that the tiny test models do not is
asserted in CONFIGS below (llama3 RoPE scaling has no tensor to convert: it is covered only in that the model is
built with it at every layout). Layouts with TP4 or TP8 at PP > 1 that no paper recipe uses are marked slow (about
20 s of CPU; the rest, about 20 s, always runs). A mapping broken in six ways must be caught."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from m2po_megatron.convert import mapping_check as mc
from m2po_megatron.models import weights
from m2po_megatron.models.hf_config import read_hf_config

ASSETS = Path(__file__).resolve().parents[2] / "m2po_megatron" / "assets" / "configs"
# config: (heads, KV heads, tied embeddings, QKV bias, q/k norms, RoPE scaling type)
CONFIGS = {
    "Qwen__Qwen2.5-32B": (40, 8, False, True, False, None),        # GQA 5:1, 64 layers, untied
    "Qwen__Qwen2.5-Math-7B": (28, 4, False, True, False, None),    # GQA 7:1, 4 KV heads: TP8 is refused
    "Qwen__Qwen3-1.7B-Base": (16, 8, True, False, True, None),     # GQA 2:1, tied
    "Qwen__Qwen3-4B-Base": (32, 8, True, False, True, None),       # GQA 4:1, tied
    "Qwen__Qwen3-8B-Base": (32, 8, False, False, True, None),      # GQA 4:1, untied
    "meta-llama__Llama-3.2-3B-Instruct": (24, 8, True, False, False, "llama3"),  # GQA 3:1, tied, llama3 RoPE
}


def _spec(name):
    return read_hf_config(str(ASSETS / name / "config.json"))


# mixture-of-experts configs, swept apart (test_moe_converts_there_and_back): at EP1 every rank holds all 128
# experts of its layers, each split over ETP = TP ranks, so a layout costs about 15 s of CPU. Expert parallelism
# itself (which rank holds which expert) is checked by the conversion at EP2 (tests/convert/test_convert.py).
MOE = ["Qwen__Qwen3-30B-A3B-Base"]


def test_the_bundled_configs_are_the_ones_described():
    assert sorted(p.name for p in ASSETS.iterdir() if (p / "config.json").is_file()) == sorted([*CONFIGS, *MOE])
    assert all(_spec(name).is_moe for name in MOE)
    for name, (heads, kv, tied, bias, qk, rope) in CONFIGS.items():
        s = _spec(name)
        got = (s.num_attention_heads, s.num_key_value_heads, s.tie_word_embeddings, s.qkv_bias, s.qk_norm,
               "llama3" if s.rope_scaling else None)  # the spec keeps only llama3 scaling's parameters
        assert got == (heads, kv, tied, bias, qk, rope), name


def _recipe_layouts() -> set[tuple[str, int, int]]:
    """(config, TP, PP) of each paper recipe (recipes/paper/*.yaml)."""
    import yaml

    out = set()
    for f in sorted((ASSETS.parents[2] / "recipes" / "paper").glob("*.yaml")):
        r = yaml.safe_load(f.read_text())
        cfg = (r.get("model") or {}).get("hf_config")
        if cfg and Path(cfg).parent.name not in MOE:  # not in this sweep (above)
            par = r.get("parallel") or {}
            out.add((Path(cfg).parent.name, par.get("tensor_model_parallel_size", 1),
                     par.get("pipeline_model_parallel_size", 1)))
    return out


RECIPES = _recipe_layouts()


def _layouts():
    """Every config x every valid layout. Always run: every TP at PP1, PP2 and PP4 at TP2 (the stage split, a
    middle stage, a tied output layer's copy across TP ranks) and each paper recipe's own layout, ~40 % of the
    sweep's time; the rest (TP4 and TP8 at PP > 1) is marked slow."""
    out = []
    for name in sorted(CONFIGS):
        for tp, pp in mc.valid_layouts(_spec(name))[0]:
            fast = pp == 1 or tp == 2 or (name, tp, pp) in RECIPES
            out.append(pytest.param(name, tp, pp, id=f"{name}-tp{tp}-pp{pp}",
                                    marks=() if fast else pytest.mark.slow))
    return out


def test_the_sweep_is_every_valid_layout_and_holds_the_recipes():
    ids = {(p.values[0], p.values[1], p.values[2]) for p in _layouts()}
    assert len(ids) == 6 * 12 - 3  # Qwen2.5-Math-7B's 4 KV heads refuse TP8 at every PP
    assert RECIPES and RECIPES <= ids, RECIPES - ids
    assert ("Qwen__Qwen2.5-32B", 8, 2) in RECIPES


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,tp,pp", _layouts())
def test_converts_there_and_back(name, tp, pp):
    assert mc.check_mapping(_spec(name), tp, pp) == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), pytest.param(2, 8, marks=pytest.mark.slow)])
def test_moe_converts_there_and_back(tp, pp):
    """Qwen3-30B-A3B: the router (replicated) and every expert's gate/up/down (fc1 / row over ETP) land whole in
    one slice each and come back, at TP1, TP2 x PP2 (experts split over 2 ranks, layers over 2 stages) and the
    recipe's TP2 x PP8 (slow)."""
    assert mc.check_mapping(_spec(MOE[0]), tp, pp) == []


def test_only_tp8_of_the_4_kv_head_model_is_refused():
    for name in CONFIGS:
        bad = set(mc.valid_layouts(_spec(name))[1])
        assert bad == ({(8, pp) for pp in mc.PPS} if CONFIGS[name][1] < 8 else set()), name


def test_more_tp_ranks_than_kv_heads_is_refused_naming_the_field():
    msg = mc.valid_layouts(_spec("Qwen__Qwen2.5-Math-7B"))[1][(8, 1)]
    assert "num_key_value_heads = 4" in msg and "tensor_model_parallel_size = 8" in msg
    assert "use a divisor of 4" in msg
    # a config with fewer KV heads than TP ranks, all else valid: refused before anything is built
    two = dataclasses.replace(_spec("Qwen__Qwen3-8B-Base"), num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"num_key_value_heads = 2 .*tensor_model_parallel_size = 4; use a "
                                         r"divisor of 2"):
        mc.check_mapping(two, 4, 1)
    assert mc.check_mapping(two, 2, 1) == []  # as many TP ranks as KV heads: one KV head per rank


def _broken(kind):
    real_shard, real_hf = weights.to_megatron_shard, weights.to_hf

    def shard(spec, rule, hf, tp_rank=0, tp_size=1):
        if kind == "qkv_ungrouped" and rule.kind == "qkv":  # q, k, v whole, then split: not per KV group
            return torch.cat(list(hf), 0).chunk(tp_size, 0)[tp_rank]
        if kind == "fc1_swapped" and rule.kind == "fc1":
            hf = hf[::-1]
        if kind == "vocab_rank0" and rule.kind == "column":  # every rank gets rank 0's rows: overlap and gap
            return real_shard(spec, rule, hf, 0, tp_size)
        return real_shard(spec, rule, hf, tp_rank, tp_size)

    def to_hf(spec, rule, shards, layer=None):
        out = real_hf(spec, rule, shards, layer)
        if kind == "row_reversed" and rule.kind == "row" and len(shards) > 1:  # the export's gather out of order
            out = real_hf(spec, rule, list(shards)[::-1], layer)
        return out

    return shard, to_hf


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,expect", [
    ("qkv_ungrouped", "self_attn.q_proj.weight: HF -> Megatron (TP2 x PP2) -> HF puts other elements"),
    ("fc1_swapped", "mlp.gate_proj.weight: HF -> Megatron (TP2 x PP2) -> HF puts other elements"),
    ("vocab_rank0", "model.embed_tokens.weight: HF -> Megatron (TP2 x PP2) -> HF puts other elements"),
    ("row_reversed", "linear_proj.weight: to_hf of the 2 TP ranks' shards does not give back"),
])
def test_a_broken_mapping_is_caught(monkeypatch, kind, expect):
    shard, to_hf = _broken(kind)
    monkeypatch.setattr(weights, "to_megatron_shard", shard)
    monkeypatch.setattr(weights, "to_hf", to_hf)
    problems = mc.check_mapping(_spec("Qwen__Qwen3-1.7B-Base"), 2, 2)
    assert problems and any(expect in p for p in problems), problems[:5]


def test_a_wrong_shape_and_a_missing_layer_are_caught(monkeypatch):
    from m2po_megatron.models import loading

    real = weights.to_megatron_shard

    def row_on_dim0(spec, rule, hf, tp_rank=0, tp_size=1):
        if rule.kind == "row":
            return hf[0].chunk(tp_size, 0)[tp_rank]
        return real(spec, rule, hf, tp_rank, tp_size)

    monkeypatch.setattr(weights, "to_megatron_shard", row_on_dim0)
    problems = mc.check_mapping(_spec("Qwen__Qwen3-1.7B-Base"), 2, 1)
    assert any("linear_proj.weight (TP 0/2, stage 0/1): Megatron's shape" in p for p in problems), problems[:3]
    monkeypatch.setattr(weights, "to_megatron_shard", real)

    real_named = loading.global_named_parameters

    def without_layer_3(chunk):  # a stage whose parameters skip one layer: its stored slots stay empty
        return ((n, p) for n, p in real_named(chunk) if not n.startswith("decoder.layers.3."))

    monkeypatch.setattr(loading, "global_named_parameters", without_layer_3)
    mc._READS.clear()
    try:
        problems = mc.check_mapping(_spec("Qwen__Qwen3-1.7B-Base"), 1, 2)
    finally:
        mc._READS.clear()
    assert any("stored, but not a view of a mapped parameter" in p for p in problems), problems[:3]


def test_the_conversion_model_of_a_tied_last_stage_stays_on_meta(monkeypatch):
    """hf_to_megatron at PP > 1 with tied embeddings: megatron copied the last stage's output-layer weight to CUDA
    (and all-reduced it with the embedding) unless told the model is on meta. A meta tensor cannot be copied, so
    on a GPU machine the conversion crashed; CPU runs hid it (cpu_compat makes .cuda() a no-op)."""
    from m2po_megatron.convert.checkpoint import _build_meta

    def no_copy(self, *a, **k):
        raise AssertionError(f"Tensor.cuda() on a {self.device} tensor")

    monkeypatch.setattr(torch.Tensor, "cuda", no_copy)
    with mc.fake_rank(2, 2, 1, 1):
        model = _build_meta(_spec("meta-llama__Llama-3.2-3B-Instruct"), torch.bfloat16)
    assert model.output_layer.weight.is_meta and model.post_process and not model.pre_process


@pytest.mark.timeout(120)
def test_the_hf_side_is_transformers_own_model_of_each_config():
    """The HF names and shapes the check starts from (models.weights.expected_hf_shapes) are those of
    transformers' model class for each real config (built on the meta device); a tied lm_head is the embedding
    (HF checkpoints do not store it)."""
    import transformers

    for name in CONFIGS:
        cfg = transformers.AutoConfig.from_pretrained(str(ASSETS / name))
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        have = {n: tuple(p.shape) for n, p in model.state_dict().items()}
        spec = _spec(name)
        if spec.tie_word_embeddings:
            assert model.lm_head.weight is model.model.embed_tokens.weight, name
            del have["lm_head.weight"]
        assert have == {n: tuple(s) for n, s in weights.expected_hf_shapes(spec).items()}, name
