"""models/colocated_memory.py: both phases of a colocated step on one shared GPU, the refusal of a layout that
cannot fit (exit 2, naming the phase, the amount and the fix), `m2po config`'s report of both phases, and the
rehearsal's report with the released engine's share held back. In-process and arithmetic only."""
import pytest

from m2po_megatron.cli import main
from m2po_megatron.config import ConfigError, estimate_memory, load_config, model_hf_config
from m2po_megatron.models.colocated_memory import (DEFAULT_MEM_FRACTION_STATIC, ENGINE_RELEASED_GB,
                                                   TRAINER_OFFLOADED_GB, colocated_from_config,
                                                   engine_kv_bytes_per_token, estimate_colocated, phase_errors)
from m2po_megatron.models.memory import GiB, param_count

Q8 = "recipes/paper/qwen3-8b-base.yaml"
COLOCATE = ["cluster.colocate=true", "cluster.rollout_nodes=0", "rollout.num_servers=8", "rollout.tp_size=1"]
CFG = "m2po_megatron/assets/configs/Qwen__Qwen3-8B-Base/config.json"


def test_both_phases_by_their_parts():
    trainer = {"total": 40.0}
    est = estimate_colocated(CFG, trainer, rollout_tp=2, context_tokens=4096, gpu_memory_gb=80.0)
    g, t = est["generation"], est["training"]
    weights = param_count(CFG) * 2 / 2 / GiB  # bf16 over TP 2
    assert g["engine_weights"] == pytest.approx(weights)
    # SGLang's sizing: mem_fraction_static of the GPU less the weights and what the offloaded trainer keeps
    assert g["kv_pool"] == pytest.approx(80 * DEFAULT_MEM_FRACTION_STATIC - weights - TRAINER_OFFLOADED_GB)
    assert g["kv_min"] == pytest.approx(4096 * engine_kv_bytes_per_token(CFG, 2) / GiB)
    assert engine_kv_bytes_per_token(CFG, 2) == 2 * 36 * 4 * 128 * 2  # Qwen3-8B: 8 KV heads over TP 2, bf16
    assert g["total"] == pytest.approx(80.0)  # the engine takes the GPU, by SGLang's design
    assert t["total"] == pytest.approx(40.0 + ENGINE_RELEASED_GB) and est["over"] == {}
    assert est["peak"] == max(g["total"], t["total"]) and est["peak_phase"] == "generation"
    # fp8 weights halve the engine's share; without the GPU's memory the KV pool is the least it must be
    fp8 = estimate_colocated(CFG, trainer, rollout_tp=2, context_tokens=4096, quantization="fp8")
    assert fp8["generation"]["engine_weights"] == pytest.approx(weights / 2)
    assert fp8["generation"]["kv_pool"] == fp8["generation"]["kv_min"] and fp8["over"] == {}


def test_each_phase_that_cannot_fit_is_named_with_its_shortfall():
    small = estimate_colocated(CFG, {"total": 30.0}, rollout_tp=1, context_tokens=32768, gpu_memory_gb=24.0,
                               mem_fraction_static=0.8)
    assert set(small["over"]) == {"generation", "training"}
    assert small["over"]["training"] == pytest.approx(30.0 + ENGINE_RELEASED_GB - 24.0)
    g = small["generation"]
    assert small["over"]["generation"] == pytest.approx(g["kv_min"] - g["kv_pool"])
    gen, train = phase_errors(small)
    assert "generation phase" in gen and f"{small['over']['generation']:.1f} GiB short" in gen
    assert "rollout.tp_size" in gen and "rollout.mem_fraction_static" in gen
    assert "training phase" in train and f"{small['over']['training']:.1f} GiB over" in train
    assert "tensor/pipeline parallel" in train
    # a wider engine leaves room: its weights and KV heads split over TP 4
    wide = estimate_colocated(CFG, {"total": 10.0}, rollout_tp=4, context_tokens=32768, gpu_memory_gb=24.0,
                              mem_fraction_static=0.8)
    assert wide["over"] == {} and phase_errors(wide) == []


def test_validation_refuses_a_colocated_layout_that_cannot_fit(capsys):
    """The same recipe fits disaggregated at 55 GiB but not colocated: the released engine's share tips the
    training phase over; validation says so before anything starts (exit 2)."""
    cfg = load_config(Q8, ["cluster.gpu_memory_gb=80"], check_files=False)
    trainer = estimate_memory(cfg)["total"]
    gpu = trainer + ENGINE_RELEASED_GB / 2  # the trainer fits alone, not beside the released engine
    load_config(Q8, [f"cluster.gpu_memory_gb={gpu}"], check_files=False)  # disaggregated: fits
    with pytest.raises(ConfigError, match="training phase does not fit") as e:
        load_config(Q8, [f"cluster.gpu_memory_gb={gpu}", *COLOCATE], check_files=False)
    assert f"{ENGINE_RELEASED_GB / 2:.1f} GiB over" in str(e.value) and "estimated trainer memory" not in str(e.value)
    # the generation phase: a long context whose KV a TP-1 engine cannot hold beside its weights
    long = ["cluster.gpu_memory_gb=80", "rollout.mem_fraction_static=0.2", *COLOCATE]
    assert main(["config", Q8, *long, "--no-check-files"]) == 2
    err = capsys.readouterr().err
    assert "generation phase does not fit" in err and "GiB short" in err and "rollout.tp_size" in err


def test_config_reports_both_phases(capsys):
    assert main(["config", Q8, *COLOCATE, "--no-check-files"]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("# colocated")]
    cfg = load_config(Q8, COLOCATE, check_files=False)
    est = colocated_from_config(cfg, model_hf_config(cfg), estimate_memory(cfg))
    assert f"-> {est['training']['total']:.1f} GiB" in line and "generation:" in line and "released engine" in line
    assert f"peak {est['peak']:.1f} GiB" in line
    assert main(["config", Q8, "--no-check-files"]) == 0
    assert "# colocated" not in capsys.readouterr().out  # only when colocated


def test_rehearsal_report_counts_the_held_back_share():
    """rehearse/plan.report: a stage traced with the engine's share held (the fake block's bytes in the result)
    has it in the estimate at the traced settings and in the recipe's training-phase estimate, so the error is
    like for like; commands/rehearse holds it back only when colocated."""
    from m2po_megatron.commands.rehearse import colocated_estimate, colocated_held_back
    from m2po_megatron.rehearse.plan import estimates, report

    cfg = load_config("recipes/paper/qwen3-1.7b-base.yaml", ["cluster.colocate=true", "cluster.rollout_nodes=0"],
                      check_files=False)
    hf = model_hf_config(cfg)
    held = colocated_held_back(cfg)
    assert held == int(ENGINE_RELEASED_GB * GiB)
    assert colocated_held_back(load_config("recipes/paper/qwen3-1.7b-base.yaml", [], check_files=False)) == 0
    kw = {"params_dtype": "bf16", "sequence_parallel": True}
    est_t, est_r = estimates(cfg, hf, 0, dict(kw, microbatches=2))
    traced = (est_t["total"] - est_t["overhead"]) * GiB + held  # a stage whose trace matches the formula
    res = {"ok": True, "role": "only", "pp_rank": 0, "result": {
        "peak_bytes": traced, "held_back_bytes": held, "params": 1, "chunks": 1, "microbatches": 2, "sequences": 4,
        "tokens": 100, "at_peak": {"engine_resident": held}, "peak_phase": "temporaries", "collectives": [],
        "build_s": 0, "step_s": 0, "dispatch_cache": {}}}
    (s,) = report(cfg, hf, [res], kw, 80.0)["stages"]
    assert s["error_pct"] == pytest.approx(0.0, abs=1e-9) and s["held_back_gib"] == pytest.approx(ENGINE_RELEASED_GB)
    assert s["estimate_recipe_gib"] == pytest.approx(est_r["total"] + ENGINE_RELEASED_GB)
    co = colocated_estimate(cfg, hf)
    assert co["training"]["engine_released"] == ENGINE_RELEASED_GB and "generation" in co
