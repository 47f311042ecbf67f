"""Colocated layouts as runnable proposals (plan/colocated.py, `m2po plan --colocated-out`), and calibration on a
colocated run's swap phases (plan/calibrate.py) from a synthetic RUN_DIR written as run/metrics.py and
infra/trace.py write them. In-process."""

import pytest
from omegaconf import OmegaConf

from m2po_megatron.cli import main
from m2po_megatron.config import load_config
from m2po_megatron.models.colocated_memory import ENGINE_RELEASED_GB
from m2po_megatron.plan.calibrate import COLOCATE_PHASES, calibrate
from synthetic_trace import LOOP, SERVER, TRAINER, span, write_trace

Q8 = "recipes/paper/qwen3-8b-base.yaml"


def test_the_colocated_proposal_carries_overrides_that_validate():
    from m2po_megatron.plan.colocated import colocated

    cfg = load_config(Q8, ["train.prompts_per_step=16"], check_files=False)
    co = colocated(cfg, 8, 8, "h100", seeds=1, measured=2)
    ov, lay = co.overrides, co.layout
    assert ov["cluster.colocate"] is True and ov["cluster.rollout_nodes"] == 0 and ov["rollout.dp_size"] == 1
    # the layout rule: the engines cover exactly the trainer's GPUs
    assert ov["rollout.num_servers"] * ov["rollout.tp_size"] == lay.tp * lay.pp * lay.dp == 8
    assert ov["staleness.mode"] == "fixed_lag"  # the recipe's synchronous mode is kept
    c = load_config(Q8, ["train.prompts_per_step=16", *co.dotted()], check_files=False)  # raises if refused
    assert c.cluster.colocate and c.parallel.tensor_model_parallel_size == lay.tp
    # memory: the training phase, the trainer beside the released engine's share, within the GPU
    from m2po_megatron.config import estimate_memory

    assert co.memory_gb == pytest.approx(estimate_memory(c)["total"] + ENGINE_RELEASED_GB, rel=0.02)
    assert co.memory_gb <= ov["cluster.gpu_memory_gb"]
    # a bounded recipe is proposed on-policy, with lag 0, and still validates
    bounded = ["train.prompts_per_step=16", "staleness.mode=bounded", "staleness.lag_steps=0",
               "staleness.behav_logprob_source=engine"]
    b = load_config(Q8, bounded, check_files=False)
    cob = colocated(b, 8, 8, "h100", seeds=1, measured=2)
    assert cob.overrides["staleness.mode"] == "on_policy"
    load_config(Q8, [*bounded, *cob.dotted()], check_files=False)


def test_plan_writes_the_colocated_layout_as_a_recipe(tmp_path, capsys):
    out = tmp_path / "colocated.yaml"
    code = main(["plan", Q8, "--gpus", "8", "--top", "1", "--seeds", "1", "--steps", "2",
                 "--colocated-out", str(out), "train.prompts_per_step=16"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "does not run" not in text and "colocated overrides: " in text and f"written to {out}" in text
    cfg = load_config(str(out), check_files=False)  # extends the recipe, with the command line's overrides
    assert cfg.cluster.colocate and cfg.cluster.rollout_nodes == 0 and cfg.train.prompts_per_step == 16
    p = cfg.parallel
    assert cfg.rollout.num_servers * cfg.rollout.tp_size == p.tensor_model_parallel_size * \
        p.pipeline_model_parallel_size * p.data_parallel_size


# a synchronous colocated step (seconds): generation, then the swap and training, then the sync, nothing overlapping
GEN_S, TRAIN_FIXED, FB_PER_TOKEN, OPT_S, SYNC_S, LOOP_S = 0.5, 0.02, 3e-5, 0.01, 0.05, 0.01
SWAP = {"release": 0.04, "reload": 0.12, "offload": 0.08, "resume_weights": 0.03, "resume_kv": 0.06}
TOKENS, STEPS = 4000, 8


def build_colocated_run(tmp_path, spans=True):
    """RUN_DIR of a colocated on-policy run: config.yaml, metrics.jsonl (run/metrics.MetricsLogger's rows) and
    trace.json. Per step: resume_kv opens the wait (inside it), generation; release between the wait and the
    train step; reload, the update and offload inside the train step; resume_weights inside the weight sync."""
    from m2po_megatron.run.metrics import MetricsLogger

    cfg = load_config("tiny-cpu", ["cluster.colocate=true", "staleness.mode=on_policy"], check_files=False)
    run = tmp_path / "run"
    run.mkdir(parents=True)
    OmegaConf.save(cfg, run / "config.yaml")
    loop, rank, server, swap, t = [], [], [], [], 0.0
    with MetricsLogger(run) as log:
        for k in range(STEPS):
            w0 = t
            swap.append(("resume_kv", t, t + SWAP["resume_kv"]))
            g0 = t + SWAP["resume_kv"]
            for i in range(10):  # the engine's decode steps
                server.append(("decode", g0 + i * GEN_S / 10, g0 + (i + 0.9) * GEN_S / 10, {"b": 64, "kv": 4000}))
            w1 = g0 + GEN_S
            swap.append(("release", w1, w1 + SWAP["release"]))
            s0 = w1 + SWAP["release"]
            swap.append(("reload", s0, s0 + SWAP["reload"]))
            u = s0 + SWAP["reload"] + TRAIN_FIXED
            rank.append(("forward_backward", u, u + FB_PER_TOKEN * TOKENS))
            u += FB_PER_TOKEN * TOKENS
            rank.append(("optimizer", u, u + OPT_S))
            u += OPT_S
            swap.append(("offload", u, u + SWAP["offload"]))
            s1 = u + SWAP["offload"]
            swap.append(("resume_weights", s1, s1 + SWAP["resume_weights"]))
            y1 = s1 + SWAP["resume_weights"] + SYNC_S
            loop += [("wait_rollout", w0, w1, {}), ("train_step", s0, s1, {"step": k}), ("weight_sync", s1, y1, {})]
            t = y1 + LOOP_S
            log.log({"time/wait_rollout": w1 - w0, "time/train": s1 - s0, "time/weight_sync": y1 - s1,
                     "time/step": t - w0, **{f"time/colocate/{p}": v for p, v in SWAP.items()},
                     "batch/tokens": TOKENS, "batch/sequences": 64, "response_length/mean": 20.0,
                     "response_length/std": 4.0, "reward/mean": 0.5, "staleness/mean": 0.0, "staleness/max": 0},
                    step=k + 1)
    write_trace(run, [span(LOOP, "loop", "loop", n, a, b, args) for n, a, b, args in loop]
                + [span(TRAINER, "main", "train", "train_step", a, b) for n, a, b, _ in loop if n == "train_step"]
                + [span(TRAINER, "phases", "train", n, a, b) for n, a, b in rank]
                + [span(SERVER, "engine", "engine", n, a, b, args) for n, a, b, args in server]
                + ([span(LOOP, "loop", "colocate", f"colocate/{p}", a, b) for p, a, b in swap] if spans else []))
    return run


def test_calibration_reads_the_swap_phases(tmp_path):
    run = build_colocated_run(tmp_path)
    cal = calibrate(run, skip=2, cores=2)
    co = cal.fit["colocate"]
    for p in COLOCATE_PHASES:
        assert co[p] == pytest.approx(SWAP[p])
    assert co["swap_s"] == pytest.approx(sum(SWAP.values()))
    assert co["in_wait_s"] == pytest.approx(SWAP["resume_kv"], rel=1e-3)  # only resume_kv lies in the wait
    c = cal.costs
    # release lies outside every loop span: in the loop's residual already; resume_kv is added to it
    assert c.loop_fixed_s == pytest.approx(LOOP_S + SWAP["release"] + SWAP["resume_kv"], rel=1e-3)
    # reload and offload lie in the train step: its fixed part; resume_weights in the sync
    assert c.train_fixed_s == pytest.approx(TRAIN_FIXED + SWAP["reload"] + SWAP["offload"], rel=1e-3)
    assert c.sync_fixed_s == pytest.approx(SYNC_S + SWAP["resume_weights"], rel=1e-3)
    assert c.train_per_token_s == pytest.approx(FB_PER_TOKEN, rel=1e-3)
    # every second of the step is in one term: the fixed terms sum to the measured step less the generation
    # and the per-token and per-update work
    step = GEN_S + sum(SWAP.values()) + TRAIN_FIXED + FB_PER_TOKEN * TOKENS + OPT_S + SYNC_S + LOOP_S
    assert c.loop_fixed_s + c.train_fixed_s + c.sync_fixed_s + GEN_S + FB_PER_TOKEN * TOKENS + OPT_S == \
        pytest.approx(step, rel=1e-3)
    # a run that traced no colocate spans: every phase counts as outside the loop's spans
    bare = calibrate(build_colocated_run(tmp_path / "b", spans=False), skip=2, cores=2)
    assert bare.fit["colocate"]["spans"] == 0 and bare.fit["colocate"]["in_wait_s"] == 0.0


def test_a_gpu_calibration_prices_the_planners_swap(tmp_path):
    """On a GPU, the measured reload and offload give the host link's efficiency and the engine's release and
    resume its fixed seconds; plan/colocated.swap_s then reproduces the measured swap."""
    from m2po_megatron.commands.plan import colocate_efficiency
    from m2po_megatron.config import estimate_memory, model_hf_config
    from m2po_megatron.plan.colocated import swap_s

    cal = calibrate(build_colocated_run(tmp_path), skip=2, cores=0)
    cfg = load_config(Q8, ["cluster.colocate=true", "cluster.rollout_nodes=0"], check_files=False)
    hf = model_hf_config(cfg)
    eff = colocate_efficiency(cal, cfg, hf, "h100")
    assert eff["swap_fixed_s"] == pytest.approx(SWAP["release"] + SWAP["resume_weights"] + SWAP["resume_kv"])
    est = estimate_memory(cfg, hf)
    state = est["weights"] + est["grads"] + est["optimizer"]
    assert swap_s(state, "h100", eff) == pytest.approx(sum(SWAP.values()))
    assert swap_s(state, "h100") < swap_s(state, "h100", {"host_link": 0.25})  # a slower link costs more
