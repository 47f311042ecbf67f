"""The rollout client's host time per generated sample (Costs.client_per_sample_s): plan/calibrate.py recovers it
from a synthetic timeline built forward from a known value, and plan/sim.py adds it to the wait for generation
(every sample of a synchronous step; in bounded mode only the samples answered while the loop waits)."""
import dataclasses
import json
import random

import pytest
from omegaconf import OmegaConf

from m2po_megatron.config import load_config
from m2po_megatron.plan.calibrate import calibrate
from m2po_megatron.plan.costs import Costs
from m2po_megatron.plan.runs import generation_key, retime, run_one, summarize
from m2po_megatron.plan.sim import LengthDist, SimSpec, simulate
from synthetic_trace import LOOP, SERVER, TRAINER, span, write_trace

CLIENT_S = 4e-4  # the client's host seconds per sample, outside every modelled span
SAMPLES = 256


def build_run(tmp_path, steps=10, seed=0):
    """A synchronous run: each step's wait holds the client's sending (a share of its time) before the engine's
    prefills and decode steps, a trainer log-prob pass and a colocated resume after them (modelled elsewhere,
    so not the client's), then its scoring (the rest); then training and a weight sync. The engine's spans
    come in bursts, with the client's gaps between some of them."""
    rng = random.Random(seed)
    cfg = load_config("tiny-cpu", check_files=False)
    run = tmp_path / "run"
    run.mkdir()
    OmegaConf.save(cfg, run / "config.yaml")
    loop, rank, engine, coloc, rows = [], [], [], [], []
    t, generated = 0.0, 0
    for k in range(steps):
        n = SAMPLES * (2 if k == 0 else 1)  # fixed lag 1: the first step generates two batches
        client = n * CLIENT_S * rng.uniform(0.9, 1.1)  # jitter: the median is what is recovered
        send, u = client * 0.3, t
        u += send / 2  # half the sending before the first prefill, half between the bursts
        for burst in range(2):
            engine.append(("prefill", u, u + 0.01, {"tokens": 500}))
            u += 0.01
            for _ in range(rng.randint(5, 12)):
                engine.append(("decode", u, u + 0.004, {"b": 128, "kv": 4000}))
                u += 0.004
            if burst == 0:
                u += send / 2
        rank.append(("logprob_pass", u, u + 0.05, "phases"))
        rank.append(("recompute", u, u + 0.05, "main"))
        u += 0.05
        coloc.append(("resume_kv", u, u + 0.003))
        u += 0.003 + client - send  # scoring and grouping
        loop.append(("wait_rollout", t, u, {}))
        start = u
        phases, v = [], start + 0.01
        for _ in range(2):
            for name, w in (("forward_backward", 0.05), ("optimizer", 0.004)):
                phases.append((name, v, v + w, "phases"))
                v += w
        end = v + 0.01
        loop.append(("train_step", start, end, {"step": k}))
        rank += phases + [("train_step", start, end, "main")]
        loop.append(("weight_sync", end, end + 0.02, {}))
        generated += n
        rows.append({"step": k + 1, "time/wait_rollout": u - t, "time/train": end - start,
                     "time/weight_sync": 0.02, "time/step": end + 0.03 - t, "batch/tokens": 9000,
                     "batch/sequences": SAMPLES, "samples/generated": generated, "response_length/mean": 19.0,
                     "response_length/std": 2.0, "reward/mean": 0.6, "staleness/mean": 2.0, "staleness/max": 2})
        t = end + 0.03
    write_trace(run, [span(LOOP, "loop", "loop", n, a, b, args) for n, a, b, args in loop]
                + [span(LOOP, "loop", "colocate", n, a, b) for n, a, b in coloc]
                + [span(TRAINER, tid, "train", n, a, b) for n, a, b, tid in rank]
                + [span(SERVER, "engine", "engine", n, a, b, args) for n, a, b, args in engine])
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_calibration_recovers_the_clients_time_per_sample(tmp_path):
    cal = calibrate(build_run(tmp_path), skip=2, cores=0)
    got = cal.fit["client"]
    assert got["steps"] == 8 and got["samples"] == SAMPLES
    # the median of the jittered steps, within the jitter; the trainer's pass and the resume are not counted
    assert cal.costs.client_per_sample_s == pytest.approx(CLIENT_S, rel=0.06)
    assert got["prefills_per_step"] == 2
    # without samples/generated, batch/sequences counts them
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "samples/generated"})
                                               + "\n" for r in rows))
    assert calibrate(run, skip=2, cores=0).costs.client_per_sample_s == pytest.approx(CLIENT_S, rel=0.06)


COSTS = Costs(train_fixed_s=0.2, train_per_update_s=0.05, train_per_token_s=2e-5, logprob_per_token_s=7e-6,
              decode_fixed_s=0.01, decode_per_seq_s=1e-4, decode_per_kv_s=1e-7, prefill_per_token_s=1e-5,
              max_running=48, sync_fixed_s=0.1, sync_per_byte_s=1e-9, weight_bytes=1e6, loop_fixed_s=0.03)
WITH = dataclasses.replace(COSTS, client_per_sample_s=CLIENT_S)


def spec(mode, **kw):
    base = dict(mode=mode, groups_per_step=8, n=4, updates_per_step=2, prompt_len=30,
                response=LengthDist(40, 0.6, 96), num_servers=2, lag_steps=1 if mode == "fixed_lag" else 0)
    if mode == "bounded":
        base.update(max_staleness=4, sync_interval=2)
    return SimSpec(**{**base, **kw})


@pytest.mark.parametrize("mode", ["on_policy", "fixed_lag"])
def test_a_synchronous_step_waits_for_the_client_on_every_sample_it_generates(mode):
    without, with_ = (simulate(spec(mode), c, steps=4, seed=3) for c in (COSTS, WITH))
    for k, (a, b) in enumerate(zip(without.steps, with_.steps)):
        samples = 32 * (2 if mode == "fixed_lag" and k == 0 else 1)  # the first fixed-lag step fills the lag
        assert b["wait_s"] - a["wait_s"] == pytest.approx(samples * CLIENT_S, rel=1e-9)
        assert b["train_s"] == pytest.approx(a["train_s"], rel=1e-12)
    # the shared generation of the trainer layouts keeps it (plan/runs.py)
    sp = spec(mode)
    direct = summarize(sp, run_one(sp, WITH, 3, seed=5))
    derived = summarize(sp, retime(run_one(*generation_key(sp, WITH), 3, seed=5), sp, WITH))
    for key, v in direct.items():
        assert derived[key] == pytest.approx(v, rel=1e-9, abs=1e-12), key


def test_bounded_charges_the_client_only_while_the_loop_waits():
    # a slow trainer: the window is full whenever a step ends, so the loop never waits and the client's
    # work overlaps training
    slow = dataclasses.replace(COSTS, train_fixed_s=30.0)
    a, b = (simulate(spec("bounded"), c, steps=6, seed=1).summary()
            for c in (slow, dataclasses.replace(slow, client_per_sample_s=CLIENT_S)))
    assert b["step_s"] == pytest.approx(a["step_s"], rel=1e-9)
    # a fast trainer waits for generation: the samples answered during a wait are on the critical path (equal
    # lengths, so that the two runs draw the same schedule); the servers go on meanwhile, so the run is longer
    # by less than every sample's client time
    fast = dataclasses.replace(COSTS, train_fixed_s=0.0, train_per_token_s=0.0)
    sp = spec("bounded", response=LengthDist(40, 0.0, 96))
    a, b = (simulate(sp, c, steps=8, seed=1) for c in (fast, dataclasses.replace(fast, client_per_sample_s=CLIENT_S)))
    assert 0 < b.window_s - a.window_s < sum(r["samples"] for r in b.steps) * CLIENT_S
    assert b.steps[0]["wait_s"] > a.steps[0]["wait_s"]


def test_a_calibrated_client_time_reaches_the_planners_costs():
    from m2po_megatron.models.memory import model_shape, param_count
    from m2po_megatron.plan.costs import Layout, efficiency_of, from_hardware

    cfg = "m2po_megatron/assets/configs/Qwen__Qwen3-8B-Base/config.json"
    shape, n, lay = model_shape(cfg), param_count(cfg), Layout(2, 1, 1, 1, 8)
    c = from_hardware(shape, n, lay, "h100", micro_batches=3, mean_context=1800.0,
                      efficiency={"client_per_sample_s": CLIENT_S})
    assert c.client_per_sample_s == CLIENT_S
    assert efficiency_of(c, shape, n, lay, "h100", micro_batches=3, mean_context=1800.0)["client_per_sample_s"] \
        == CLIENT_S
    assert from_hardware(shape, n, lay, "h100", micro_batches=3, mean_context=1800.0).client_per_sample_s == 0.0
