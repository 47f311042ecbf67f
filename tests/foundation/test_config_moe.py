"""Config validation of mixture-of-experts layouts (Qwen3-30B-A3B): expert parallel sizes against the model and
the trainer's ranks, routing replay and EP refused on a dense model, the new fields' ranges, and the memory
estimate that counts each rank's share of the experts."""
import pytest

from m2po_megatron.config import ConfigError, load_config
from m2po_megatron.config.validation import estimate_memory, moe_dims

MOE = "model.hf_config=m2po_megatron/assets/configs/Qwen__Qwen3-30B-A3B-Base"
DENSE = "model.hf_config=m2po_megatron/assets/configs/Qwen__Qwen3-8B-Base"


def err(overrides):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    return str(e.value)


def test_an_expert_layout_that_fits_passes():
    cfg = load_config(None, [MOE, "parallel.data_parallel_size=8", "parallel.expert_model_parallel_size=8",
                             "algo.routing_replay=r3"])
    assert cfg.parallel.expert_model_parallel_size == 8 and cfg.algo.routing_replay == "r3"


@pytest.mark.parametrize("overrides, needle", [
    # 128 experts over 3 ranks
    (["parallel.data_parallel_size=3", "parallel.expert_model_parallel_size=3"],
     "num_experts = 128 (model config) is not divisible by parallel.expert_model_parallel_size = 3"),
    # 768 / 5
    (["parallel.data_parallel_size=5", "parallel.expert_tensor_parallel_size=5"],
     "moe_intermediate_size = 768 (model config) is not divisible by parallel.expert_tensor_parallel_size = 5"),
    # EP 8 needs 8 ranks per stage: DP 4 gives 4
    (["parallel.data_parallel_size=4", "parallel.expert_model_parallel_size=8"],
     "the 4 ranks of a pipeline stage"),
    # megatron-core refuses MoE with TP > 1 and no sequence parallelism in training
    (["parallel.tensor_model_parallel_size=2", "parallel.expert_tensor_parallel_size=1"],
     "parallel.sequence_parallel = false with tensor_model_parallel_size = 2"),
])
def test_expert_layouts_that_do_not_fit_name_the_field(overrides, needle):
    assert needle in err([MOE, *overrides])


def test_moe_dims_reads_the_expert_dimensions_of_a_moe_architecture_only():
    hf = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128, "moe_intermediate_size": 768}
    assert moe_dims(hf) == (128, 768)
    # transformers 5 spells it num_local_experts; a dense architecture is dense whatever its keys say
    assert moe_dims({"architectures": ["Qwen3MoeForCausalLM"], "num_local_experts": 64,
                     "moe_intermediate_size": 512}) == (64, 512)
    assert moe_dims({"architectures": ["Qwen3ForCausalLM"], "num_experts": 8}) == (None, None)


def test_moe_intermediate_size_replaces_intermediate_size_in_the_layout_check(tmp_path):
    """A MoE config whose (unused) intermediate_size TP does not divide still validates: only what is built is
    checked."""
    import json

    from m2po_megatron.models.hf_config import load_hf_config_dict

    hf = load_hf_config_dict("m2po_megatron/assets/configs/Qwen__Qwen3-30B-A3B-Base")
    (tmp_path / "config.json").write_text(json.dumps(dict(hf, intermediate_size=6145)))
    cfg = load_config(None, [f"model.hf_config={tmp_path}", "parallel.tensor_model_parallel_size=2",
                             "parallel.sequence_parallel=true", "model.attention_backend=te",
                             "parallel.data_parallel_size=2", "parallel.expert_model_parallel_size=2"])
    assert cfg.parallel.tensor_model_parallel_size == 2
    dense = load_hf_config_dict("m2po_megatron/assets/configs/Qwen__Qwen3-8B-Base")
    (tmp_path / "config.json").write_text(json.dumps(dict(dense, intermediate_size=12289)))
    assert "intermediate_size = 12289" in err([f"model.hf_config={tmp_path}", "parallel.tensor_model_parallel_size=2"])


@pytest.mark.parametrize("overrides, needle", [
    (["algo.routing_replay=r2"], "algo.routing_replay = r2 replays the experts of a mixture-of-experts model; "
                                 "Qwen3ForCausalLM is dense: use none"),
    (["algo.routing_replay=r3"], "Qwen3ForCausalLM is dense: use none"),
    (["parallel.data_parallel_size=2", "parallel.expert_model_parallel_size=2"],
     "parallel.expert_model_parallel_size = 2 needs a mixture-of-experts model"),
])
def test_a_dense_model_refuses_expert_settings(overrides, needle):
    assert needle in err([DENSE, *overrides])


@pytest.mark.parametrize("override, needle", [
    ("parallel.expert_model_parallel_size=0", "parallel.expert_model_parallel_size = 0 must be > 0"),
    ("parallel.expert_tensor_parallel_size=0", "parallel.expert_tensor_parallel_size = 0 must be >= 1, or null"),
    ("model.moe_aux_loss_coeff=-0.001", "model.moe_aux_loss_coeff = -0.001 must be >= 0"),
    ("algo.routing_replay=r5", "algo.routing_replay = 'r5' is not one of: none, r2, r3"),
])
def test_field_ranges(override, needle):
    assert needle in err([override])  # no model config needed


def test_the_estimate_counts_each_ranks_experts():
    """EP 8 over DP 8 leaves each rank 16 of the 128 experts: far less than all of them at EP 1."""
    ep1 = load_config(None, [MOE, "parallel.data_parallel_size=8", "cluster.gpus_per_node=8"], check_files=False)
    ep8 = load_config(None, [MOE, "parallel.data_parallel_size=8", "parallel.expert_model_parallel_size=8",
                             "cluster.gpus_per_node=8"], check_files=False)
    a, b = estimate_memory(ep1), estimate_memory(ep8)
    assert a["expert_params_per_gpu_billion"] == pytest.approx(48 * 128 * 3 * 2048 * 768 / 1e9)
    assert b["expert_params_per_gpu_billion"] == pytest.approx(a["expert_params_per_gpu_billion"] / 8)
    assert b["weights"] < a["weights"] / 4
    with_aux = load_config(None, [MOE, "parallel.data_parallel_size=8", "parallel.expert_model_parallel_size=8",
                                  "cluster.gpus_per_node=8", "model.moe_aux_loss_coeff=0.001"], check_files=False)
    assert estimate_memory(with_aux)["activations"] > b["activations"]  # the aux loss keeps [T, E] fp32 scores
