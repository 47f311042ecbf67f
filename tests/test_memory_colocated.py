"""models/colocated_memory.py: the three phases of a colocated step on one shared GPU (generation, training,
weight_sync), the refusal of a layout that cannot fit (exit 2, naming the phase, the amount and the fix),
`m2po config`'s report of the phases, and the rehearsal's report with the released engine's share held back.
In-process and arithmetic only."""
import pytest

from m2po_megatron.cli import main
from m2po_megatron.config import ConfigError, estimate_memory, load_config, model_hf_config
from m2po_megatron.config.schema import RolloutSection
from m2po_megatron.models.colocated_memory import (DEFAULT_MEM_FRACTION_STATIC, ENGINE_RELEASED_GB, PHASES,
                                                   SYNC_BUCKET_MB, SYNC_BUCKETS_HELD, TRAINER_OFFLOADED_GB,
                                                   colocated_from_config, engine_kv_bytes_per_token,
                                                   estimate_colocated, phase_errors, sync_bucket_bytes)
from m2po_megatron.models.memory import GiB, param_count

Q8 = "recipes/paper/qwen3-8b-base.yaml"
COLOCATE = ["cluster.colocate=true", "cluster.rollout_nodes=0", "rollout.num_servers=8", "rollout.tp_size=1"]
CFG = "m2po_megatron/assets/configs/Qwen__Qwen3-8B-Base/config.json"


def trainer_est(total: float, static: float = 0.0) -> dict:
    """A trainer estimate of `total` GiB whose parts that outlive a step (weights, grads, optimizer states,
    overhead) sum to `static` (default: the total less nothing but activations)."""
    static = static or total / 2
    return {"weights": static / 4, "grads": static / 4, "optimizer": static / 4, "overhead": static / 4,
            "activations": total - static, "logits": 0.0, "optimizer_step": 0.0, "total": total}


def test_both_phases_by_their_parts():
    trainer = trainer_est(40.0)
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
    small = estimate_colocated(CFG, trainer_est(30.0, 3.0), rollout_tp=1, context_tokens=32768, gpu_memory_gb=24.0,
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
    wide = estimate_colocated(CFG, trainer_est(10.0), rollout_tp=4, context_tokens=32768, gpu_memory_gb=24.0,
                              mem_fraction_static=0.8)
    assert wide["over"] == {} and phase_errors(wide) == []


def test_weight_sync_phase_by_its_parts_and_as_the_peak():
    """The moment between the engines' resume of their weights and the trainer's offload: the trainer without
    its activations, the engine's weights, the sync's buckets and the released engine's share."""
    trainer = trainer_est(30.0, 20.0)  # 10 GiB of activations, freed when the sync starts
    est = estimate_colocated(CFG, trainer, rollout_tp=1, context_tokens=4096)
    w = est["weight_sync"]
    weights = param_count(CFG) * 2 / GiB  # bf16, one engine GPU
    # Qwen3-8B's largest HF tensor, the [151936, 4096] bf16 embedding, is above 512 MiB: a bucket of its own
    bucket = 151936 * 4096 * 2
    assert sync_bucket_bytes(CFG) == bucket > SYNC_BUCKET_MB * 2**20
    assert w["trainer_static"] == pytest.approx(20.0) and w["engine_weights"] == pytest.approx(weights)
    assert w["buckets"] == pytest.approx(SYNC_BUCKETS_HELD * bucket / GiB)
    assert w["total"] == pytest.approx(20.0 + weights + SYNC_BUCKETS_HELD * bucket / GiB + ENGINE_RELEASED_GB)
    # 20 + 15.3 + 2.3 + 2 GiB beats the training phase (30 + 2) and a KV pool of one sequence
    assert est["peak_phase"] == "weight_sync" and est["peak"] == w["total"]
    assert est["peak"] == max(est[p]["total"] for p in PHASES)
    # a bucket size above the largest tensor is what the sender holds; fp32 params double a tensor's bytes
    big = estimate_colocated(CFG, trainer, rollout_tp=1, context_tokens=4096, bucket_mb=2048)
    assert big["weight_sync"]["buckets"] == pytest.approx(SYNC_BUCKETS_HELD * 2.0)
    assert sync_bucket_bytes(CFG, tensor_bytes=4) == 2 * bucket
    assert RolloutSection().bucket_mb == SYNC_BUCKET_MB  # the schema's default is the constant documented
    # with activations as large as the engine's share the training phase stays the peak
    assert estimate_colocated(CFG, trainer_est(60.0, 20.0), rollout_tp=1, context_tokens=4096)["peak_phase"] == \
        "training"
    # a reference model kept on the GPU (algo.ref_param_offload = false) is still there at the sync
    ref = estimate_colocated(CFG, {**trainer, "reference_on_gpu": 3.0}, rollout_tp=1, context_tokens=4096)
    assert ref["weight_sync"]["total"] == pytest.approx(w["total"] + 3.0)
    with pytest.raises(ValueError, match="lacks"):
        estimate_colocated(CFG, {"total": 30.0}, rollout_tp=1, context_tokens=4096)


def test_a_layout_that_fits_training_and_generation_but_not_the_sync_is_refused(capsys):
    """Full recomputation makes the trainer's activations small: training fits a 45 GiB GPU beside the released
    engine, the engine's KV pool holds the longest sequence, but the trainer's states, the engine's 15 GiB of
    weights at TP 1 and the buckets do not fit together while the new weights go across."""
    ov = [*COLOCATE, "parallel.recompute_granularity=full"]
    cfg = load_config(Q8, ov, check_files=False)
    est = colocated_from_config(cfg, model_hf_config(cfg), estimate_memory(cfg), gpu_memory_gb=45.0)
    assert est["training"]["total"] < 45.0 < est["weight_sync"]["total"]
    assert set(est["over"]) == {"weight_sync"}
    assert main(["config", Q8, *ov, "cluster.gpu_memory_gb=45", "--no-check-files"]) == 2
    err = capsys.readouterr().err
    assert "weight_sync phase does not fit" in err and f"{est['over']['weight_sync']:.1f} GiB over" in err
    assert "rollout.tp_size" in err and "rollout.bucket_mb = 512" in err
    assert "training phase" not in err and "generation phase" not in err
    # an engine over two GPUs halves its weights' share: the same GPU then fits
    wider = [o.replace("rollout.tp_size=1", "rollout.tp_size=2").replace("num_servers=8", "num_servers=4")
             for o in ov]
    assert main(["config", Q8, *wider, "cluster.gpu_memory_gb=45", "--no-check-files"]) == 0


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
    assert f"weight_sync: trainer without activations {est['weight_sync']['trainer_static']:.1f}" in line
    assert f"-> {est['weight_sync']['total']:.1f} GiB" in line
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
