"""The tiny task's MoE option (`tools/build_tiny_model.py --moe`, `make demo-moe`): a tiny Qwen3-MoE that
transformers and our config reader load as such, the same task as the dense build, and recipes/tiny-moe-cpu.yaml
valid on it. Warm-ups of 4 steps: what is checked is the model's shape and the task, not its accuracy."""

import json

import pytest
import torch

from m2po_megatron.config import ConfigError, load_config
from m2po_megatron.demo.tiny_model import (INFO_FILE, TinyModelSpec, TinyMoeSpec, tiny_lm, warmup_loss,
                                           build_tiny_task)
from tools.build_tiny_model import main as build_main

SMALL = ["--seed", "0", "--n-eval", "32", "--n-calibration", "32", "--n-train", "64", "--max-warmup-steps", "4"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    assert build_main([str(root / "moe"), *SMALL, "--moe"]) == 0
    build_tiny_task(root / "dense", seed=0, n_eval=32, n_calibration=32, n_train=64, max_warmup_steps=4,
                    log=lambda *_: None)
    return root


@pytest.mark.timeout(300)
def test_the_moe_build_is_a_qwen3_moe_with_every_layer_sparse(built):
    from transformers import AutoModelForCausalLM

    from m2po_megatron.models.hf_config import read_hf_config

    d, dense, moe = built / "moe", TinyModelSpec(), TinyMoeSpec()
    spec = read_hf_config(d)
    assert spec.is_moe and spec.architecture == "Qwen3MoeForCausalLM"
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (4, 2, 128)
    assert spec.norm_topk_prob and not spec.tie_word_embeddings and spec.router_aux_loss_coef == 0.001
    assert (spec.hidden_size, spec.num_layers, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim) \
        == (dense.hidden_size, dense.num_hidden_layers, dense.num_attention_heads, dense.num_key_value_heads, 24)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["decoder_sparse_step"] == 1 and cfg["mlp_only_layers"] == []
    # on disk, one tensor per expert and projection (what SGLang and the converter read)
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    for layer in range(dense.num_hidden_layers):
        assert f"model.layers.{layer}.mlp.gate.weight" in names
        for e in range(moe.num_experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" in names
    lm = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert type(lm).__name__ == "Qwen3MoeForCausalLM" and "lm_head.weight" in names
    assert all(layer.mlp.gate.top_k == 2 and layer.mlp.gate.num_experts == 4 for layer in lm.model.layers)
    info = json.loads((d / INFO_FILE).read_text())
    assert info["moe"] == {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                           "router_aux_loss_coef": 0.001}
    assert info["parameters"] == sum(p.numel() for p in lm.parameters())
    assert "moe" not in json.loads((built / "dense" / INFO_FILE).read_text())  # the dense build's keys as before


def test_the_moe_option_changes_the_model_only(built):
    """The same tokenizer and problems as the dense build: the MoE demo is the dense demo's task."""
    for name in ("train.jsonl", "eval.jsonl", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (built / "moe" / name).read_bytes() == (built / "dense" / name).read_bytes(), name
    moe_info, dense_info = (json.loads((built / k / INFO_FILE).read_text()) for k in ("moe", "dense"))
    assert moe_info["warmup_steps"] == dense_info["warmup_steps"] == 4


def test_the_warmup_adds_the_routers_load_balancing_loss():
    """transformers adds router_aux_loss_coef x aux_loss only when asked for the router logits; the warm-up asks."""
    from m2po_megatron.demo.tiny_tokenizer import build_tiny_tokenizer

    tok, moe = build_tiny_tokenizer(), TinyMoeSpec(router_aux_loss_coef=0.5)  # large enough to tell apart
    torch.manual_seed(0)
    lm = tiny_lm(tok, TinyModelSpec(), moe)
    ids = torch.randint(3, len(tok), (2, 12))
    att, lab = torch.ones_like(ids), ids.clone()
    plain = lm(input_ids=ids, attention_mask=att, labels=lab)
    routed = lm(input_ids=ids, attention_mask=att, labels=lab, output_router_logits=True)
    assert plain.aux_loss is None and routed.aux_loss > 0
    got = warmup_loss(lm, ids, att, lab, moe)
    torch.testing.assert_close(got, plain.loss + 0.5 * routed.aux_loss)
    assert torch.equal(warmup_loss(lm, ids, att, lab, None), plain.loss)  # dense: the plain loss


def test_the_moe_recipe_validates_on_the_built_model(built):
    """recipes/tiny-moe-cpu.yaml on this model: EP 2 divides its 4 experts and its 2 ranks, R3 needs a MoE model."""
    d = built / "moe"
    paths = [f"model.hf_path={d}", f"data.train_path={d / 'train.jsonl'}", f"data.eval_paths=[{d / 'eval.jsonl'}]"]
    cfg = load_config("tiny-moe-cpu", paths)
    p = cfg.parallel
    assert (p.tensor_model_parallel_size, p.data_parallel_size, p.expert_model_parallel_size) == (1, 2, 2)
    assert cfg.algo.routing_replay == "r3" and cfg.run.name == "tiny-moe-cpu"
    dense = built / "dense"
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        load_config("tiny-moe-cpu", [f"model.hf_path={dense}", *paths[1:]])
