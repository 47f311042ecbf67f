"""plan/ on a mixture-of-experts model (Qwen3-30B-A3B): FLOPs from the active parameters, memory and the weight
sync from all of them, the decode step's expert read, the trainer's all-to-all, the expert-parallel layouts of
the search, and a plan of the MoE recipe whose rows validate."""
import pytest

from m2po_megatron.config import load_config
from m2po_megatron.models.memory import active_param_count, model_shape, param_count
from m2po_megatron.plan.costs import Layout, attention_flops, from_hardware
from m2po_megatron.plan.hardware import EFFICIENCY, GPUS

CFG = "m2po_megatron/assets/configs/Qwen__Qwen3-30B-A3B-Base/config.json"
S, N = model_shape(CFG), param_count(CFG)
EXPERTS = 48 * 128 * 3 * 2048 * 768
PEAK, HBM = 989e12, 3.35e12  # H100
ONE = {"mfu": 1.0, "hbm": 1.0, "link": 1.0}
RECIPE = "recipes/paper/qwen3-30b-a3b.yaml"


def costs(lay=Layout(1, 1, 1, 1, 1), ctx=0.0, **kw):
    return from_hardware(S, N, lay, "h100", micro_batches=1, mean_context=ctx, efficiency=ONE, **kw)


def test_training_flops_count_the_active_parameters():
    """6 x (active parameters less the untied input embedding) + attention per token, at MFU 1 on one GPU."""
    active_mm = active_param_count(CFG) - S.vocab * S.hidden
    c = costs(ctx=1000.0)
    assert c.train_per_token_s * PEAK == pytest.approx(6 * active_mm + attention_flops(S, 1000.0), rel=1e-12)
    assert c.prefill_per_token_s * PEAK * 0.5 == pytest.approx(2 * active_mm, rel=1e-9)  # prefill efficiency 0.5


def test_the_weight_sync_and_the_kv_pool_count_every_parameter():
    c = costs()
    assert c.weight_bytes == 2 * N == 2 * 30_532_122_624
    pool = GPUS["h100"].memory_gb * 1e9 * 0.85 - 2 * N
    kv_token = 2 * 48 * 4 * 128 * 2
    assert c.max_running == int(min(EFFICIENCY["max_running_cap"], pool / kv_token / 1.0))


def test_a_decode_step_reads_the_experts_its_batch_chose():
    """Per layer E x (1 - (1 - k/E)^B) distinct experts expected: 8 of 128 for one sequence, nearly all for
    hundreds."""
    c = costs()
    rest = (N - S.vocab * S.hidden - EXPERTS) * 2  # attention, router, norms, output layer: read every step
    assert c.weights_s(1) * HBM == pytest.approx(rest + EXPERTS * 2 * 8 / 128, rel=1e-12)
    for b in (4, 32):
        assert c.weights_s(b) * HBM == pytest.approx(rest + EXPERTS * 2 * (1 - (1 - 8 / 128) ** b), rel=1e-12)
    assert c.weights_s(256) * HBM == pytest.approx(rest + EXPERTS * 2, rel=1e-6)
    # the step itself: the roofline with that read, and the decode lower bound takes the least (one sequence)
    assert c.decode_step_s(32, 0.0) == pytest.approx(c.decode_fixed_s + max(32 * c.decode_per_seq_s,
                                                                            c.weights_s(32)))
    assert c.decode_lb(10, 0.0, 10) == pytest.approx(10 * c.decode_fixed_s + max(10 * c.decode_per_seq_s,
                                                                                  10 * c.weights_s(1)))


def test_the_decode_sums_match_step_by_step_with_the_expert_read():
    c = costs()
    for batch, kv0, steps in ((1, 100.0, 50), (16, 5000.0, 300), (200, 1e5, 40)):
        brute = sum(c.decode_step_s(batch, kv0 + i * batch) for i in range(steps))
        assert c.decode_s(steps, batch, kv0) == pytest.approx(brute, rel=1e-9)
        assert c.steps_within(brute, batch, kv0) == steps


def test_expert_parallelism_pays_the_token_dispatch():
    """EP 8 in a node adds 2 all-to-alls forward and 2 backward per layer, k copies of hidden x 2 bytes each,
    7/8 leaving the rank, over NVLink; EP 16 crosses nodes (InfiniBand). TP 2 halves a rank's share."""
    base = costs(Layout(1, 1, 8, 1, 8))
    per_token = 48 * 4 * 8 * 2048 * 2 / 8  # per global token: each of 8 replicas sees 1/8 of the tokens
    ep8 = costs(Layout(1, 1, 8, 1, 8, ep=8))
    assert (ep8.train_per_token_s - base.train_per_token_s) * 450e9 == pytest.approx(per_token * 7 / 8, rel=1e-9)
    assert (ep8.logprob_per_token_s - base.logprob_per_token_s) * 450e9 == pytest.approx(per_token * 7 / 16)
    base16 = costs(Layout(1, 1, 16, 1, 8))
    ep16 = costs(Layout(1, 1, 16, 1, 8, ep=16), gpus_per_node=8)
    assert (ep16.train_per_token_s - base16.train_per_token_s) * 50e9 == pytest.approx(
        48 * 4 * 8 * 2048 * 2 / 16 * 15 / 16, rel=1e-9)


def test_expert_gradients_reduce_over_expert_data_parallel():
    """DP 8: dense gradients reduce-scatter over 8 ranks (fp32) and gather back (bf16); at EP 8 each expert
    lives on one rank (expert-DP 1: nothing to reduce), at EP 2 over 4."""
    dense = N - EXPERTS
    for ep, edp in ((8, 1), (2, 4)):
        c = costs(Layout(1, 1, 8, 1, 8, ep=ep))
        opt = 32 * N / 8 / HBM  # the distributed optimizer: 1/8 of every parameter per rank either way
        dp = 7 / 8 * dense * 6 + ((edp - 1) / edp * EXPERTS / ep * 6 if edp > 1 else 0.0)
        assert c.train_per_update_s == pytest.approx(opt + dp / 450e9, rel=1e-12)


def test_the_search_tries_expert_parallel_sizes_with_etp_1():
    from m2po_megatron.plan.space import expert_sizes, layouts

    cfg = load_config(RECIPE, [], check_files=False)
    hf = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128}
    assert expert_sizes(hf, 16) == [1, 2, 4, 8, 16] and expert_sizes(hf, 12) == [1, 2, 4]
    assert expert_sizes({"architectures": ["Qwen3ForCausalLM"]}, 16) == [1]
    lays = layouts(cfg, 16, 8)
    eps = {(lay.tp, lay.pp, lay.dp, lay.ep) for lay, _ in lays}
    assert (1, 1, 8, 8) in eps and (2, 1, 4, 8) in eps and (1, 2, 4, 8) not in eps  # EP divides a stage's 4
    for lay, ov in lays:
        assert ov["parallel.expert_model_parallel_size"] == lay.ep and ov["parallel.expert_tensor_parallel_size"] == 1
        assert ov["parallel.sequence_parallel"] == (lay.tp > 1)  # megatron-core's MoE needs it at TP > 1
    dense = load_config("recipes/paper/qwen3-8b-base.yaml", [], check_files=False)
    assert all(lay.ep == 1 and "parallel.expert_model_parallel_size" not in ov for lay, ov in layouts(dense, 16, 8))


@pytest.mark.timeout(600)
def test_the_moe_recipe_plans_to_layouts_that_validate():
    """32 GPUs (16 do not hold the experts' optimizer states): every row fits and passes `m2po config` with its
    expert settings."""
    from m2po_megatron.plan.search import plan

    small = ["train.prompts_per_step=16", "rollout.max_new_tokens=2048", "data.max_prompt_len=512"]
    cfg = load_config(RECIPE, small, check_files=False)
    res = plan(cfg, 32, top=2, seeds=1, steps=2)
    assert res["ranked"] and res["over_memory"] > 0
    assert any(c.layout.ep > 1 for c in res["all"])  # expert-parallel layouts were simulated
    for c in res["ranked"]:
        assert c.overrides["parallel.expert_model_parallel_size"] == c.layout.ep
        assert c.memory_gb <= c.overrides["cluster.gpu_memory_gb"]
        load_config(RECIPE, small + c.dotted(), check_files=False)  # raises if invalid
