"""plan/calibrate.py recovers known costs from a timeline built forward from them: decode steps of random batch
and KV size whose wall time stretches by (1 + contention) while the trainer computes beside them, and trainer
phases stretched the same way while the server decodes. Also the command's input errors (exit 2)."""
import json
import random
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from m2po_megatron.config import load_config
from m2po_megatron.plan.calibrate import Calibration, calibrate, measured
from synthetic_trace import LOOP, SERVER, TRAINER, span, write_trace

A, B_COEF, C_COEF, ALPHA = 0.004, 2e-5, 1.5e-6, 0.35  # decode: fixed, per sequence, per KV token; contention
FB_PER_TOKEN, LP_PER_TOKEN, OPT_S, FIXED_S, SYNC_S, LOOP_S = 4e-5, 1.5e-5, 0.004, 0.03, 0.1, 0.01
TOKENS, U = 10_000, 2


class Timeline:
    """Forward model: the server decodes back to back; the trainer computes in [t0, t1) windows. While both
    are busy each runs at 1 / (1 + ALPHA) (two threads on two cores with contention)."""

    def __init__(self):
        self.busy = []  # trainer windows (wall)

    def stretch(self, t: float, work: float, other: list) -> float:
        """Wall end of `work` solo seconds started at t, slowed inside `other`'s intervals."""
        for a, b in sorted(other):
            if b <= t:
                continue
            if t < a:  # alone until a
                if t + work <= a:
                    return t + work
                work -= a - t
                t = a
            slow = (b - t) / (1 + ALPHA)
            if work <= slow:
                return t + work * (1 + ALPHA)
            work -= slow
            t = b
        return t + work


def build_run(tmp_path, steps=10):
    rng = random.Random(0)
    cfg = load_config("tiny-cpu", check_files=False)
    run = tmp_path / "run"
    (run / "trace").mkdir(parents=True)
    OmegaConf.save(cfg, run / "config.yaml")
    loop, rank, server, rows = [], [], [], []
    tl = Timeline()
    t = 0.0
    train_windows = []
    # the trainer's steps: 1.5 s apart, each a known amount of work, stretched where the server decodes (always)
    for k in range(steps):
        start = t + 0.2  # waiting
        phases, u = [], start + FIXED_S / 2 * (1 + ALPHA)
        for _ in range(U):
            for name, w in (("logprob_pass", LP_PER_TOKEN * TOKENS / U),
                            ("forward_backward", FB_PER_TOKEN * TOKENS / U), ("optimizer", OPT_S)):
                end = u + w * (1 + ALPHA)
                phases.append((name, u, end))
                u = end
        end = u + FIXED_S / 2 * (1 + ALPHA)
        train_windows.append((start, end))
        loop.append(("wait_rollout", t, start, {}))
        loop.append(("train_step", start, end, {"step": k}))
        rank.append(("train_step", start, end, {"tokens": TOKENS, "seqs": 256, "updates": U}, "main"))
        rank += [(n, a, b, None, "phases") for n, a, b in phases]
        sync_end = end + SYNC_S
        loop.append(("weight_sync", end, sync_end, {}))
        rows.append({"step": k + 1, "time/wait_rollout": 0.2, "time/train": end - start, "time/weight_sync": SYNC_S,
                     "time/step": sync_end + LOOP_S - t, "batch/tokens": TOKENS, "batch/sequences": 256,
                     "response_length/mean": 19.0, "response_length/std": 2.0, "reward/mean": 0.6,
                     "staleness/mean": 3.0, "staleness/max": 4})
        t = sync_end + LOOP_S
    # the server: decode steps back to back over the whole run, but not during weight syncs (paused)
    pauses = [(a, b) for n, a, b, _ in loop if n == "weight_sync"]
    s = 0.0
    while s < t:
        p = next(((a, b) for a, b in pauses if a <= s < b), None)
        if p:
            s = p[1]
            continue
        b, kv = rng.randint(20, 256), rng.randint(500, 9000)
        e = tl.stretch(s, A + B_COEF * b + C_COEF * kv, train_windows)
        server.append(("decode", s, e, {"b": b, "kv": kv}))
        s = e + 0.001
    write_trace(run, [span(LOOP, "loop", "loop", n, a, b, args) for n, a, b, args in loop]
                + [span(TRAINER, tid, "train", n, a, b, args or None) for n, a, b, args, tid in rank]
                + [span(SERVER, "engine", "engine", n, a, b, args) for n, a, b, args in server])
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_calibration_recovers_the_costs_and_the_contention(tmp_path):
    run = build_run(tmp_path)
    cal = calibrate(run, skip=2, cores=2)
    c = cal.costs
    assert cal.fit["contention"] == pytest.approx(ALPHA, abs=0.021)  # the grid's step is 0.02
    assert c.decode_fixed_s == pytest.approx(A, rel=0.03)
    assert c.decode_per_seq_s == pytest.approx(B_COEF, rel=0.05)
    assert c.decode_per_kv_s == pytest.approx(C_COEF, rel=0.03)
    assert c.train_per_token_s == pytest.approx(FB_PER_TOKEN, rel=0.03)  # work, not the stretched wall time
    assert c.logprob_per_token_s == pytest.approx(LP_PER_TOKEN, rel=0.03)
    assert c.train_per_update_s == pytest.approx(OPT_S, rel=0.03)
    assert c.train_fixed_s == pytest.approx(FIXED_S, rel=0.05)
    assert c.sync_fixed_s == pytest.approx(SYNC_S, rel=1e-3)
    assert c.loop_fixed_s == pytest.approx(LOOP_S, rel=1e-3)
    assert c.shared_cores == 2
    assert cal.response.mean == 19.0 and cal.response.cv == pytest.approx(2 / 19)
    assert cal.prompt_len == pytest.approx(TOKENS / 256 - 19)
    assert Calibration.from_dict(json.loads(json.dumps(cal.to_dict()))).costs == c
    got = measured(run, skip=2)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()[2:]]
    assert got["step_s"] == pytest.approx(sum(r["time/step"] for r in rows) / 8)


def test_without_contention_the_fit_says_none(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ALPHA", 0.0)
    cal = calibrate(build_run(tmp_path), skip=2, cores=2)
    assert cal.fit["contention"] == 0.0
    assert cal.costs.decode_per_kv_s == pytest.approx(C_COEF, rel=0.03)


def m2po(*args):
    return subprocess.run([sys.executable, "-m", "m2po_megatron.cli", "plan", *args], capture_output=True, text=True,
                          timeout=120)


def test_plan_command_input_errors_exit_2(tmp_path):
    run = build_run(tmp_path)
    p = m2po("--calibrate", str(tmp_path / "nowhere"))
    assert p.returncode == 2 and "not a run directory" in p.stderr
    p = m2po("recipes/tiny-cpu.yaml")
    assert p.returncode == 2 and "--gpus" in p.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    p = m2po("recipes/paper/qwen3-8b-base.yaml", "--gpus", "16", "--calibration", str(bad))
    assert p.returncode == 2 and "--calibrate RUN_DIR --out FILE" in p.stderr
    p = m2po(str(run), "--skip", "50")
    assert p.returncode == 2 and "leaves out the first 50" in p.stderr
    out = tmp_path / "cal.json"
    p = m2po("--calibrate", str(run), "--skip", "2", "--out", str(out))
    assert p.returncode == 0, p.stderr
    p = m2po("recipes/paper/qwen3-8b-base.yaml", "--gpus", "16", "--calibration", str(out))
    assert p.returncode == 2 and "no GPU efficiencies" in p.stderr
    p = m2po("recipes/paper/qwen3-8b-base.yaml", "--gpus", "12")
    assert p.returncode == 2 and "whole nodes" in p.stderr
    (run / "trace.json").write_text(json.dumps({"traceEvents": [  # a decode span without its batch size
        {"ph": "X", "pid": 1, "tid": "engine", "cat": "engine", "name": "decode", "ts": 1, "dur": 2}]}))
    p = m2po("--calibrate", str(run))
    assert p.returncode == 2 and "lack what a run writes" in p.stderr and "Traceback" not in p.stderr


CFG = "m2po_megatron/assets/configs/Qwen__Qwen3-8B-Base/config.json"


@pytest.mark.parametrize("layout,kw", [
    ((2, 1, 1, 1, 8), {}),  # dp 1, a TP 1 server
    ((2, 2, 4, 4, 2), {"fp8": True}),  # FP8, dp 4 over NVLink, a TP 4 server (its all-reduces)
    ((1, 1, 16, 8, 1), {"same_node_sync": True, "use_distributed_optimizer": False}),  # dp 16 over InfiniBand
])
def test_efficiency_of_inverts_from_hardware(layout, kw):
    """efficiency_of(from_hardware(eff)) == eff term by term, for from_hardware's roofline and for the sum form
    a calibration fits (the weight read inside decode_fixed_s)."""
    import dataclasses

    from m2po_megatron.models.memory import model_shape, param_count
    from m2po_megatron.plan.costs import Layout, efficiency_of, from_hardware

    shape, n, lay = model_shape(CFG), param_count(CFG), Layout(*layout)
    eff = {"mfu": 0.41, "hbm": 0.63, "decode_compute": 0.44, "prefill": 0.57, "link": 0.31, "decode_fixed_s": 0.003,
           "train_fixed_s": 0.8}
    args = dict(micro_batches=3, mean_context=1800.0, **kw)
    c = from_hardware(shape, n, lay, "h100", efficiency=eff, **args)
    got = efficiency_of(c, shape, n, lay, "h100", **args)
    assert got == pytest.approx(eff, rel=1e-9)
    again = from_hardware(shape, n, lay, "h100", efficiency=got, **args)
    for f in dataclasses.fields(c):
        a, b = getattr(c, f.name), getattr(again, f.name)
        assert (a == pytest.approx(b, rel=1e-9)) if isinstance(a, float) else (f.name == "source" or a == b), f.name
    fitted = dataclasses.replace(c, decode_fixed_s=c.decode_fixed_s + c.decode_weights_s, decode_weights_s=0.0,
                                 decode_roofline=False)
    assert efficiency_of(fitted, shape, n, lay, "h100", **args) == pytest.approx(eff, rel=1e-9)


def test_a_calibration_is_the_sum_form_and_old_files_still_load(tmp_path):
    cal = calibrate(build_run(tmp_path), skip=2, cores=2)
    assert not cal.costs.decode_roofline and cal.costs.decode_weights_s == 0.0
    doc = json.loads(json.dumps(cal.to_dict()))
    assert Calibration.from_dict(doc).costs == cal.costs
    for k in ("decode_weights_s", "decode_roofline"):  # written before these fields existed
        del doc["costs"][k]
    assert Calibration.from_dict(doc).costs == cal.costs
