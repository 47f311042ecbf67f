"""`m2po plan` with a reference model (algo.use_kl_loss): its forward-only pass in the step's time, its weights'
host-to-GPU copy when offloaded, and its memory in the layouts' fit check (plan/costs.py, plan/space.py)."""
from __future__ import annotations

import pytest

from m2po_megatron.config import load_config, model_hf_config
from m2po_megatron.models.memory import model_shape, param_count
from m2po_megatron.plan.costs import Layout, expert_params, from_hardware
from m2po_megatron.plan.hardware import EFFICIENCY, GPUS
from m2po_megatron.plan.space import layout_costs, spec_from_config, trainer_memory

CFG = "m2po_megatron/assets/configs/{}/config.json"
Q8, N8 = model_shape(CFG.format("Qwen__Qwen3-8B-Base")), param_count(CFG.format("Qwen__Qwen3-8B-Base"))
LAY = Layout(tp=2, pp=2, dp=2, rollout_tp=1, num_servers=8)


def _costs(reference, shape=Q8, params=N8, lay=LAY, **kw):
    return from_hardware(shape, params, lay, "h100", micro_batches=4, mean_context=2000.0, reference=reference, **kw)


def test_the_reference_pass_is_added_only_when_on():
    off, resident = _costs(None), _costs("resident")
    assert (off.reference_per_token_s, off.reference_copy_s) == (0.0, 0.0)
    # a forward-only pass over the step's tokens: priced as the log-prob pass, and nothing to copy
    assert resident.reference_per_token_s == off.logprob_per_token_s > 0 and resident.reference_copy_s == 0.0
    tokens = 1e6
    assert resident.train_s(tokens, 2, False) - off.train_s(tokens, 2, False) == pytest.approx(
        tokens * off.logprob_per_token_s)
    # M2PO's own log-prob pass is another pass: both are counted
    assert resident.train_s(tokens, 2, True) - off.train_s(tokens, 2, False) == pytest.approx(
        2 * tokens * off.logprob_per_token_s)


def test_offload_adds_the_weights_copy_over_the_host_link():
    resident, offloaded = _costs("resident"), _costs("offloaded")
    rank_bytes = 2 * N8 / (LAY.tp * LAY.pp)  # bf16, one rank's share of the weights
    copy = rank_bytes / (GPUS["h100"].pcie_gb_s * 1e9 * EFFICIENCY["link"])
    assert offloaded.reference_copy_s == pytest.approx(copy)  # 4.1 GB at 32 GB/s: 0.13 s a step
    assert offloaded.train_s(1e6, 2, False) - resident.train_s(1e6, 2, False) == pytest.approx(copy)
    # a calibration's measured host link takes the place of the link efficiency
    assert _costs("offloaded", efficiency={"host_link": 0.8}).reference_copy_s == pytest.approx(copy * 0.5 / 0.8)
    with pytest.raises(ValueError, match="reference"):
        _costs("on_the_gpu")


def test_moe_copies_its_expert_parallel_share():
    hf = CFG.format("Qwen__Qwen3-30B-A3B-Base")
    shape, n = model_shape(hf), param_count(hf)
    lay = Layout(tp=2, pp=8, dp=2, rollout_tp=2, num_servers=4, ep=4)
    c = _costs("offloaded", shape, n, lay)
    e = expert_params(shape)
    rank = ((n - e) / 2 + e / 4) / 8 * 2
    assert c.reference_copy_s == pytest.approx(rank / (GPUS["h100"].pcie_gb_s * 1e9 * EFFICIENCY["link"]))


def test_the_recipe_reaches_the_costs_and_the_fit_check():
    base = load_config("recipes/paper/qwen3-8b-base.yaml", [], check_files=False)
    on = load_config("recipes/paper/qwen3-8b-base.yaml", ["algo.use_kl_loss=true"], check_files=False)
    resident = load_config("recipes/paper/qwen3-8b-base.yaml", ["algo.use_kl_loss=true",
                                                                "algo.ref_param_offload=false"], check_files=False)
    hf = model_hf_config(base)
    spec = spec_from_config(base, num_servers=8)

    def costs(cfg):
        return layout_costs(cfg, Q8, N8, LAY, "h100", spec, 8, None, same_node_sync=False)

    assert costs(base).reference_copy_s == 0.0 and costs(base).reference_per_token_s == 0.0
    assert costs(on).reference_copy_s > 0 and costs(resident).reference_copy_s == 0.0
    # a KL penalty in the reward needs the reference's log-probs too
    in_reward = load_config("recipes/paper/qwen3-8b-base.yaml", ["algo.use_kl_in_reward=true"], check_files=False)
    assert costs(in_reward) == costs(on)
    assert costs(resident).reference_per_token_s == costs(on).reference_per_token_s > 0
    # memory: a resident reference adds its weights to the training phase, which the fit check compares
    m0, m1, m2 = (trainer_memory(c, hf, LAY) for c in (base, on, resident))
    assert m1["total"] == pytest.approx(m0["total"]) and m1["reference_pass"] < m1["total"]
    assert m2["total"] == pytest.approx(m0["total"] + m0["weights"])
