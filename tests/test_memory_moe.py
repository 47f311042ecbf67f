"""models/memory.py on a mixture-of-experts model (Qwen3-30B-A3B): parameter counts against transformers' own
model, the per-rank share of experts at EP / ETP, the optimizer states over expert-data-parallel, and what the
routed tokens add to the activations (models/moe_memory.py)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from m2po_megatron.models.hf_config import load_hf_config_dict
from m2po_megatron.models.memory import (GiB, active_param_count, estimate_gpu_memory, model_shape, param_count)

CONFIG = Path(__file__).resolve().parents[1] / "m2po_megatron/assets/configs/Qwen__Qwen3-30B-A3B-Base"
HF = load_hf_config_dict(CONFIG)
EXPERTS_PER_LAYER = 128 * 3 * 2048 * 768  # E x (gate, up, down) x H x F
KW = dict(micro_batch_tokens=8192, params_dtype="bf16", attention_backend="te")


@pytest.fixture(scope="module")
def meta_model():
    """transformers' Qwen3MoeForCausalLM from the bundled config, on the meta device (no memory)."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    kw = {k: v for k, v in HF.items() if k not in ("architectures", "torch_dtype", "transformers_version")}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(Qwen3MoeConfig(**kw))


def test_total_and_active_params_equal_transformers_model(meta_model):
    params = dict(meta_model.named_parameters())
    total = sum(p.numel() for p in params.values())
    experts = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    assert param_count(HF) == total == 30_532_122_624  # HF's published count for Qwen3-30B-A3B
    # a token goes through 8 of the 128 experts of each layer, and everything else
    assert active_param_count(HF) == total - experts + experts * 8 // 128
    assert round(active_param_count(HF) / 1e9, 1) == 3.4 and active_param_count(HF) // 10**8 == 33  # "3.3B"


def test_dense_active_params_are_all_params():
    dense = CONFIG.parent / "Qwen__Qwen3-8B-Base"
    assert active_param_count(dense) == param_count(dense)


def test_a_rank_holds_its_share_of_the_experts():
    one = estimate_gpu_memory(HF, **KW)
    ep8 = estimate_gpu_memory(HF, data_parallel_size=8, expert_model_parallel_size=8, **KW)
    tp2_etp1 = estimate_gpu_memory(HF, tensor_model_parallel_size=2, sequence_parallel=True, data_parallel_size=4,
                                   expert_model_parallel_size=8, expert_tensor_parallel_size=1, **KW)
    assert one["expert_params_per_gpu_billion"] * 1e9 == 48 * EXPERTS_PER_LAYER
    assert ep8["expert_params_per_gpu_billion"] * 1e9 == 48 * EXPERTS_PER_LAYER / 8
    dense_part = (one["params_per_gpu_billion"] - one["expert_params_per_gpu_billion"]) * 1e9
    assert (ep8["params_per_gpu_billion"] - ep8["expert_params_per_gpu_billion"]) * 1e9 == pytest.approx(dense_part)
    # TP2 splits attention and embeddings, not the router (replicated) nor, at ETP1, the experts
    router_and_norms = 48 * (128 * 2048 + 2 * 2048 + 2 * 128) + 2048
    dense_tp2 = (tp2_etp1["params_per_gpu_billion"] - tp2_etp1["expert_params_per_gpu_billion"]) * 1e9
    assert dense_tp2 == pytest.approx((dense_part - router_and_norms) / 2 + router_and_norms)
    assert tp2_etp1["expert_params_per_gpu_billion"] == ep8["expert_params_per_gpu_billion"]
    # ETP = TP (the default) splits each expert too
    etp2 = estimate_gpu_memory(HF, tensor_model_parallel_size=2, sequence_parallel=True, data_parallel_size=4,
                               expert_model_parallel_size=4, **KW)
    assert etp2["expert_params_per_gpu_billion"] == ep8["expert_params_per_gpu_billion"]


def test_optimizer_states_shard_experts_over_expert_data_parallel():
    """TP1 x DP8: dense states over 8 ranks; EP8 leaves expert-DP 1 (each expert's states on one rank), EP2
    leaves 4."""
    for ep, edp in ((8, 1), (2, 4), (1, 8)):
        e = estimate_gpu_memory(HF, data_parallel_size=8, expert_model_parallel_size=ep, **KW)
        experts = e["expert_params_per_gpu_billion"] * 1e9
        dense = e["params_per_gpu_billion"] * 1e9 - experts
        assert e["optimizer"] * GiB == pytest.approx(12 * dense / 8 + 12 * experts / edp)
        assert e["grads"] * GiB == pytest.approx(4 * (dense + experts))


def test_routed_copies_drive_the_moe_activations():
    """Per token and layer the experts keep top-k copies of (fc1 input H, fc1 output 2F, fc2 input F) in bf16
    and a fp32 routing weight; EP does not change how many a rank receives (its DP peers send as many), ETP
    gathers ETP ranks' copies."""
    base = model_shape(HF)
    more = dataclasses.replace(base, topk=base.topk + 1)  # one more routed copy per token
    from m2po_megatron.models import memory

    a = memory.layer_saved_elements(base, attention_backend="te")
    b = memory.layer_saved_elements(more, attention_backend="te")
    h, f = base.hidden, base.expert_ffn
    assert b[0] - a[0] == h + 3 * f
    assert b[2] - a[2] == 1 + 1 + 2 + 4  # the copy's weight; softmax output; topk's and permute's int64 slots
    ep1 = estimate_gpu_memory(HF, data_parallel_size=8, **KW)["activations"]
    ep8 = estimate_gpu_memory(HF, data_parallel_size=8, expert_model_parallel_size=8, **KW)["activations"]
    assert ep1 == ep8
    kw = dict(KW, tensor_model_parallel_size=2, sequence_parallel=True, data_parallel_size=4)
    etp1 = memory.layer_saved_elements(base, tp=2, sequence_parallel=True, attention_backend="te", etp=1)
    etp2 = memory.layer_saved_elements(base, tp=2, sequence_parallel=True, attention_backend="te", etp=2)
    copies = base.topk / 2  # at ETP1: the sequence-parallel half of the tokens, k copies each
    # ETP2: twice the copies (gathered from the TP peer), each with half of fc1's and fc2's activations
    assert etp2[0] - etp1[0] == 2 * copies * (h + 3 * f / 2) - copies * (h + 3 * f)
    assert estimate_gpu_memory(HF, expert_tensor_parallel_size=1, **kw)["activations"] < \
        estimate_gpu_memory(HF, **kw)["activations"]


def test_dispatcher_state_is_one_micro_batch_per_layer_and_replay_adds_a_layers_targets():
    kw = dict(KW, pipeline_model_parallel_size=2, data_parallel_size=4)
    one = estimate_gpu_memory(HF, microbatches_in_flight=1, **kw)["activations"]
    two = estimate_gpu_memory(HF, microbatches_in_flight=2, **kw)["activations"]
    tokens, layers = 8192, 24
    state = tokens * layers * 128 * 5  # probs fp32 + routing map bool, [T, E] per layer
    last = one * GiB - state - tokens * (2048 * 2 + 4 + 8)  # what lies outside the layers (last stage)
    assert two * GiB - state - tokens * (2048 * 2 + 4 + 8) == pytest.approx(2 * last)
    r3 = estimate_gpu_memory(HF, microbatches_in_flight=1, routing_replay="r3", **kw)["activations"]
    assert (r3 - one) * GiB == pytest.approx(tokens * (8 * 8 + 1))
    aux = estimate_gpu_memory(HF, microbatches_in_flight=1, moe_aux_loss=True, **kw)["activations"]
    assert (aux - one) * GiB == pytest.approx(tokens * layers * 128 * 4)  # softmax over every expert, fp32


@pytest.mark.parametrize("kw, needle", [
    (dict(expert_model_parallel_size=3), "must divide num_experts = 128"),
    (dict(expert_tensor_parallel_size=5), "must divide moe_intermediate_size = 768"),
    (dict(expert_model_parallel_size=16, data_parallel_size=8), "not divisible by"),
    (dict(routing_replay="r4"), "routing_replay"),
])
def test_expert_layouts_that_do_not_divide_are_refused(kw, needle):
    with pytest.raises(ValueError, match=needle):
        estimate_gpu_memory(HF, **dict(KW, **kw))


def test_a_dense_model_refuses_expert_parallelism():
    with pytest.raises(ValueError, match="mixture-of-experts"):
        estimate_gpu_memory(CONFIG.parent / "Qwen__Qwen3-8B-Base", expert_model_parallel_size=2,
                            data_parallel_size=2, **KW)
