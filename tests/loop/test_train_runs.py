"""Short real runs of the RL loop on CPU: Ray, two Megatron ranks over gloo, a CPU rollout server speaking
SGLang's protocol, math-verify rewards. Each mode's staleness bound and the sample accounting identity are
read back from metrics.jsonl. Every run is a subprocess with a timeout."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from m2po_megatron.infra.trace import misnested
from m2po_megatron.run.metrics import read_metrics

RUN_TIMEOUT = 900


def overrides(task: Path, out: Path, name: str, *extra: str) -> list[str]:
    return [f"model.hf_path={task}", f"data.train_path={task / 'train.jsonl'}", "data.eval_paths=[]",
            f"run.output_dir={out}", f"run.name={name}", "train.prompts_per_step=8", "train.updates_per_step=2",
            "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=24", "eval.interval=0",
            "checkpoint.interval=0", "reward.num_workers=1", *extra]


def m2po(*args: str, timeout: int = RUN_TIMEOUT, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled", WANDB_MODE="disabled")
    return subprocess.run([sys.executable, "-m", "m2po_megatron.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, **kw)


def ok(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-6000:]}"


def steps(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "samples/generated" in r]


def assert_accounting(rows: list[dict]) -> None:
    for r in rows:
        assert r["samples/generated"] == r["samples/consumed"] + r["samples/dropped"] + r["samples/pending"], r
        assert r["samples/dropped"] == sum(v for k, v in r.items() if k.startswith("samples/dropped/")), r


@pytest.fixture()
def small_eval(tiny_task, tmp_path):
    rows = (tiny_task / "eval.jsonl").read_text().splitlines()[:8]
    path = tmp_path / "tiny_eval.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_bounded_dp2_with_eval_and_checkpoint(tiny_task, tmp_path, small_eval):
    p = m2po("train", "tiny-cpu", *overrides(
        tiny_task, tmp_path, "bounded", "parallel.tensor_model_parallel_size=1", "parallel.data_parallel_size=2",
        "parallel.use_distributed_optimizer=true", "staleness.mode=bounded", "staleness.max_staleness=2",
        "staleness.sync_interval=2", "train.steps=3", "algo.use_kl_in_reward=true", "algo.kl_ctrl.kl_coef=0.01",
        "algo.use_kl_loss=true", "algo.entropy_coeff=0.001",
        f"data.eval_paths=[{small_eval}]", "eval.interval=0", "eval.steps=[2]", "eval.n_samples=2"))
    ok(p)
    run = tmp_path / "bounded"
    rows = steps(run)
    # the KL to the reference, in the reward (the loop asked the ranks once; the step reused the values) and
    # as a loss term over DP 2 with the distributed optimizer; both 0 where the policy is still the reference
    assert all(r["kl_in_reward/coef"] == 0.01 for r in rows)  # k1 (verl's default kl_penalty) is signed:
    assert abs(rows[0]["kl_in_reward/kl"]) < 1e-5 < abs(rows[-1]["kl_in_reward/kl"])  # behaviour = reference first
    assert rows[0]["updates"][0]["kl_loss"] == 0 and rows[-1]["kl_ref/k3"] > 0
    assert all(r["time/actor/ref_pass"] == 0 for r in rows)  # the reward's pass served the loss too
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["version"] for r in rows] == [2, 4, 6]
    assert all(r["staleness/max"] <= 2 for r in rows), [r["staleness/max"] for r in rows]
    assert_accounting(rows)
    for key in ("loss", "m2po/m2_before", "m2po/m2_after", "m2po/masked_frac", "clip_frac", "kl/k3",
                "reward/mean", "response_length/mean", "staleness/token_mean", "tokens_per_s/gen",
                "tokens_per_s/train", "time/wait_rollout", "time/train", "time/weight_sync"):
        assert key in rows[-1], key
    for r in rows:  # each optimizer update's own metrics, beside the step's means and extremes
        ups = r["updates"]
        assert len(ups) == 2 and all("ratio/kept_max" in u and "m2po/masked_frac" in u for u in ups), ups
        assert r["clip_frac"] == pytest.approx(sum(u["clip_frac"] for u in ups) / 2)
        assert r["ratio/max"] == max(u["ratio/max"] for u in ups)
    evals = [r for r in read_metrics(run / "metrics.jsonl") if "eval/avg/pass@1" in r]
    assert [r["step"] for r in evals] == [0, 2, 3]  # the start, eval.steps, the end
    for r in evals:  # printed as well as logged
        assert f"[m2po] eval at step {r['step']}: pass@1 {r['eval/avg/pass@1']:.1f}% (tiny_eval " in p.stdout, p.stdout
        assert r["eval/answers_at_other_weights"] == 0  # every answer at the version synced before it (0, 4, 6)
    assert (run / "eval" / "step_000003.csv").exists()
    placement = json.loads((run / "placement.json").read_text())
    assert sorted(n["rank"] for n in placement["trainer"]) == [0, 1]
    assert (run / "config.yaml").exists() and list((run / "checkpoints").glob("step_0000003/COMPLETE"))
    assert_timeline(run, steps=3, updates=2, ranks=2, groups=3 * 8, evals=3)


def assert_timeline(run: Path, steps: int, updates: int, ranks: int, groups: int, evals: int = 2) -> None:
    """RUN_DIR/trace.json: the loop's, every rank's and every request's spans, nested as they ran; `groups`
    requests at least (the consumed groups')."""
    doc = json.loads((run / "trace.json").read_text())
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    servers = [v for v in procs.values() if v.startswith("rollout server :")]
    assert len(servers) == 1, procs  # the CPU engine's own part (M2PO_TRACE_DIR from the run)
    others = sorted(v for v in procs.values() if v not in servers)
    assert others == ["loop"] + [f"trainer rank {r}" for r in range(ranks)]
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    by = lambda proc, name, tid=None: [e for e in xs if procs[e["pid"]] == proc and e["name"] == name  # noqa: E731
                                       and (tid is None or e["tid"] == tid)]
    assert len(by("loop", "wait_rollout")) == steps and len(by("loop", "train_step")) == steps
    assert len(by("loop", "eval")) == evals
    assert by("loop", "checkpoint") and by("trainer rank 0", "checkpoint") and by("trainer rank 1", "checkpoint")
    for name in ("weight_sync", "pause", "push", "resume"):
        assert by("loop", name), name
    for r in range(ranks):
        assert len(by(f"trainer rank {r}", "train_step", "main")) == steps
        assert len(by(f"trainer rank {r}", "forward_backward", "phases")) == steps * updates
        assert len(by(f"trainer rank {r}", "optimizer", "phases")) == steps * updates
    assert by("trainer rank 0", "sync_weights")
    for outer, inner in zip(by("loop", "train_step"), by("trainer rank 0", "train_step")):  # the rank inside the loop
        assert outer["ts"] - 1e3 <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e3
    assert misnested(doc["traceEvents"]) == []  # every row nests: Perfetto shows every slice
    reqs = [e for e in xs if e["cat"] == "request"]
    assert len(reqs) >= groups and all(e["tid"].startswith("http://") and e["args"]["n"] == 4 for e in reqs)
    decode = [e for e in xs if e["cat"] == "engine" and e["name"] == "decode"]
    prefill = [e for e in xs if e["cat"] == "engine" and e["name"] == "prefill"]
    assert decode and prefill and all(1 <= e["args"]["b"] <= 256 and e["args"]["kv"] >= e["args"]["b"] for e in decode)
    for e in by("trainer rank 0", "train_step", "main"):
        assert e["args"]["tokens"] > e["args"]["seqs"] > 0
    p = m2po("plot", str(run), "--out", str(run / "p.png"), timeout=120)
    ok(p)
    assert "run timeline:" in p.stdout and "trainer rank 1: busy" in p.stdout and "server http://" in p.stdout
    assert f"{servers[0]} engine: busy" in p.stdout
    # the simulator calibrated on this run predicts it back (`m2po plan RUN_DIR`); how well is bench_plan's job
    p = m2po("plan", str(run), "--skip", "1", "--format", "json", timeout=120)
    ok(p)
    doc = json.loads(p.stdout)
    assert doc["calibrated_on"] == str(run) and doc["summary"]["step_s"]["predicted"] > 0
    assert doc["summary"]["step_s"]["measured"] == pytest.approx(
        sum(r["time/step"] for r in steps_rows(run)[1:]) / (steps - 1))


def steps_rows(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "time/step" in r]


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_on_policy_pp2(tiny_task, tmp_path):
    p = m2po("train", "tiny-cpu", *overrides(tiny_task, tmp_path, "onp", "staleness.mode=on_policy",
                                             "parallel.tensor_model_parallel_size=1",
                                             "parallel.pipeline_model_parallel_size=2",
                                             "train.steps=2", "algo.name=grpo"))
    ok(p)
    rows = steps(tmp_path / "onp")
    assert [r["staleness/max"] for r in rows] == [0, 0]  # every batch generated with the latest weights
    assert all(r["samples/pending"] == 0 for r in rows)
    assert all("weight_sync/seconds" in r for r in rows)
    # Weights relayed from both pipeline stages reached the server: at step 2 the engine's log-probs
    # (generated after the first sync) equal the trainer's at the same weights.
    assert rows[1]["logprob_mismatch/ratio_max"] == pytest.approx(1.0, abs=1e-3)
    assert rows[1]["logprob_mismatch/ratio_min"] == pytest.approx(1.0, abs=1e-3)
    assert_accounting(rows)


# The fixed-lag interrupted-and-resumed run equal to an uninterrupted one (and its staleness pattern) is in
# tests/faults/test_signals.py, where the interruption is a real SIGTERM.


def run_servers(model, run_dir) -> list[str]:
    """This run's CPU servers: the tiny model is shared by runs on other pytest-xdist workers, so a server is
    told apart by its stdout, which the launcher points at the run's own rollout/server_<i>.log."""
    logs = {str(p) for p in (run_dir / "rollout").glob("server_*.log")}
    found = []
    for pid in subprocess.run(["pgrep", "-f", f"rollout.local_server --model-path {model}"],
                              capture_output=True, text=True).stdout.split():
        try:
            if os.readlink(f"/proc/{pid}/fd/1") in logs:
                found.append(pid)
        except OSError:  # gone, or not ours to read
            pass
    return found


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_rollout_server_killed_mid_run(tiny_task, tmp_path):
    # The kill lands after step 1 is logged; a step of this run takes a fraction of a second, so the run is
    # long enough (20 steps) that it cannot end before the kill does, however fast the machine.
    args = overrides(tiny_task, tmp_path, "kill", "staleness.mode=bounded", "staleness.max_staleness=2",
                     "train.steps=20", "rollout.max_restarts=2")
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled", WANDB_MODE="disabled")
    proc = subprocess.Popen([sys.executable, "-m", "m2po_megatron.cli", "train", "tiny-cpu", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        metrics = tmp_path / "kill" / "metrics.jsonl"
        deadline = time.monotonic() + RUN_TIMEOUT
        while not (metrics.exists() and steps(tmp_path / "kill")):
            assert proc.poll() is None, proc.stdout.read()[-5000:]
            assert time.monotonic() < deadline, "no training step within the time limit"
            time.sleep(0.05)
        pids = run_servers(tiny_task, tmp_path / "kill")
        assert len(pids) == 1, pids
        os.kill(int(pids[0]), signal.SIGKILL)
        out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-6000:]
    rows = steps(tmp_path / "kill")
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert max(r.get("rollout/server_restarts", 0) for r in rows) == 1
    assert all(r["staleness/max"] <= 2 for r in rows)
    assert_accounting(rows)


def test_bad_recipe_fails_before_ray(tmp_path):
    t0 = time.monotonic()
    p = m2po("train", "tiny-cpu", "algo.name=ppo", f"run.output_dir={tmp_path}", timeout=120)
    assert p.returncode == 2 and "algo.name" in p.stderr
    assert time.monotonic() - t0 < 60 and not any(tmp_path.iterdir())  # nothing started, nothing written


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_demo_shortened(tiny_task, tmp_path, small_eval):
    p = m2po("demo", "--task-dir", str(tiny_task), f"run.output_dir={tmp_path}", "train.steps=2",
             "eval.interval=2", f"data.eval_paths=[{small_eval}]", "eval.n_samples=2", "checkpoint.interval=2")
    ok(p)
    run = tmp_path / "tiny-cpu"
    assert "held-out accuracy" in p.stdout and (run / "plot.png").stat().st_size > 10_000
    assert (run / "config.yaml").exists() and list((run / "checkpoints").glob("step_*/COMPLETE"))


@pytest.mark.timeout(3 * RUN_TIMEOUT + 60)
@pytest.mark.parametrize("mode", ["on_policy", "fixed_lag", "bounded"])
def test_filter_groups_drops_uniform_groups_with_exact_accounting(tiny_task, tmp_path, mode):
    """train.filter_groups in each staleness mode: zero-variance groups are dropped with reason
    zero_variance (every sample of the group, so the identity holds at every step), more are generated
    within the budget, each trained batch holds only informative groups, and a short batch says so. The
    bounded run also takes the three-policy objective (MIS) against a bf16 rollout server."""
    extra = {"on_policy": ["staleness.mode=on_policy"],
             "fixed_lag": ["staleness.mode=fixed_lag", "staleness.lag_steps=1"],
             "bounded": ["staleness.mode=bounded", "staleness.max_staleness=2", "staleness.sync_interval=2",
                         "rollout.dtype=bfloat16", "algo.rollout_correction.mode=mis",
                         "algo.rollout_correction.threshold=1.5"]}[mode]
    G, n, budget = 8, 4, 2
    p = m2po("train", "tiny-cpu", *overrides(tiny_task, tmp_path, mode, "parallel.tensor_model_parallel_size=1",
                                             "train.steps=3", "train.filter_groups.enable=true",
                                             f"train.filter_groups.max_num_gen_batches={budget}", *extra))
    ok(p)
    rows = steps(tmp_path / mode)
    assert len(rows) == 3
    assert_accounting(rows)
    dropped = sum(r.get("filter_groups/dropped_groups", 0) for r in rows)
    assert dropped > 0, rows  # the tiny task at ~35 % accuracy: all-wrong groups of 4 are common
    zero_var = rows[-1]["samples/dropped/zero_variance"]
    if mode == "bounded":  # background generation may drop more after the last step's counters
        assert dropped * n <= zero_var
    else:
        assert dropped * n == zero_var
        warmup = 1 if mode == "fixed_lag" else 0  # step 1 of fixed_lag also generates the lag's batch
        assert all(1 <= r["filter_groups/gen_batches"] <= budget * (1 + (warmup if i == 0 else 0))
                   for i, r in enumerate(rows))
    for r in rows:
        trained = G - r["filter_groups/unfilled_groups"]
        assert 0 <= r["filter_groups/unfilled_groups"] <= G
        if trained:
            assert r["batch/sequences"] <= trained * n and r["advantage/abs_mean"] > 0
    if mode == "bounded":
        assert all(r["rollout_corr/kl_k1"] != 0 and "rollout_corr/masked_frac" in r for r in rows)


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_staleness_and_engine_mismatch_parts_where_both_exist(tiny_task, tmp_path):
    """fixed_lag with behaviour log-probs recomputed by the trainer at the generating weights (the released
    code's choice) against a bf16 server, under TIS: engine_mismatch/* (trainer vs engine at equal weights,
    measured at generation) is bf16's rounding, and rollout_corr/* (proximal vs behaviour) the staleness
    alone: nothing at step 1 (data from the same weights), a drift at step 2 (data one step old)."""
    p = m2po("train", "tiny-cpu", *overrides(
        tiny_task, tmp_path, "parts", "parallel.tensor_model_parallel_size=1", "staleness.mode=fixed_lag",
        "staleness.lag_steps=1", "staleness.behav_logprob_source=trainer", "rollout.dtype=bfloat16",
        "algo.rollout_correction.mode=tis", "train.steps=2"))
    ok(p)
    rows = steps(tmp_path / "parts")
    assert all(0 < r["engine_mismatch/kl_k3"] < 0.05 and r["engine_mismatch/ratio_p1"] < 1 < r["engine_mismatch/ratio_p99"]
               for r in rows), rows
    assert rows[0]["rollout_corr/kl_k1"] == pytest.approx(0, abs=1e-6)  # step 1 trains on the initial weights' data
    assert rows[1]["rollout_corr/kl_k3"] > 1e-6  # step 2's data is one step (2 updates) old
