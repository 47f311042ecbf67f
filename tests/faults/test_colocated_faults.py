"""Real colocated runs (cluster.colocate, docs/colocate.md) of the tiny task, in fixed-lag mode: the goal of issue
49 (the metrics of the disaggregated run of the same seed), SIGTERM inside a swap (checkpoint, resume exactly,
the fixed-lag queue with it), and a swap that fails (a RunError, nothing left behind).

Runs are the cost here (~40 s each on the shared 2-core VM, 2026-12-06), so each is made once: two module fixtures, the
disaggregated run and the uninterrupted colocated run of the same settings, which both the equality test and
the SIGTERM test compare against. The faults land at a known call of the CPU server's swap routes
(M2PO_CPU_SERVER_HOLD / M2PO_CPU_SERVER_FAIL, rollout/server_memory.py InjectedFaults), never by polling.

Swap calls of these settings (fixed lag 1, checkpoint.interval = 0): step k of a fresh run releases the engine
once (release k), then resumes its weights (resume 2k - 1) and its KV cache (resume 2k). A resumed run first
swaps once around the restore (release 1, resumes 1 and 2), so its first new step k + 1 makes release 2 and
resume 3. With staleness.behav_logprob_source = trainer each generated batch adds a swap of its own."""
import json
import shutil
import signal
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from harness import (RUN_TIMEOUT, Driver, assert_accounting, assert_nothing_left, assert_steps_once, checkpoints,
                     placement, rollout_port, small, step_rows)

# tests/faults/test_signals.py: the fixed-lag resume equality, the same keys and tolerance
DETERMINISTIC = ("reward/mean", "response_length/mean", "loss", "grad_norm", "m2po/m2_before", "staleness/mean",
                 "staleness/max", "samples/generated", "samples/consumed", "samples/pending", "kl/k3")
PHASES = ("time/colocate/release", "time/colocate/reload", "time/colocate/resume_weights",
          "time/colocate/offload", "time/colocate/resume_kv", "time/weight_sync", "time/train", "time/wait_rollout")
STEPS = 3
# Every run of this file: the engine's behaviour log-probs (the disaggregated run's equality does not need the
# trainer's; one run below exercises them), and checkpoints only at a stop and at the end, so that the
# SIGTERM's own save (a swap around it) is what the resume reads.
SETTINGS = ("staleness.mode=fixed_lag", "staleness.lag_steps=1", f"train.steps={STEPS}", "checkpoint.interval=0")
COLOCATED = (*SETTINGS, "cluster.colocate=true")


def equal(ref: list[dict], rows: list[dict]) -> None:
    assert len(ref) == len(rows) == STEPS
    for a, b in zip(ref, rows):
        for key in DETERMINISTIC:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key, a[key], b[key])


@pytest.fixture(scope="module")
def runs_tmp():
    """The module's drivers' TMPDIRs: short (Ray's socket paths must fit 107 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="m2c", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def finished_run(task: Path, out: Path, tmp: Path, name: str, *args: str, env: dict | None = None) -> Driver:
    """One `m2po train` to its end; nothing of it is left whatever happens."""
    d = Driver(["tiny-cpu", *small(task, out, name, *args)], out / f"{name}.log", tmp, env=env)
    try:
        d.finish()
    finally:
        d.cleanup()
    return d


@pytest.fixture(scope="module")
def apart(tiny_task, tmp_path_factory, runs_tmp) -> Path:
    """The disaggregated run (weights over a gloo group)."""
    out = tmp_path_factory.mktemp("apart")
    d = finished_run(tiny_task, out, runs_tmp, "apart", *SETTINGS)
    assert d.proc.returncode == 0, d.output()[-5000:]
    return out / "apart"


@pytest.fixture(scope="module")
def colocated(tiny_task, tmp_path_factory, runs_tmp) -> Path:
    """The uninterrupted colocated run of the same settings: the equality's colocated side and the SIGTERM
    test's reference."""
    out = tmp_path_factory.mktemp("colo")
    d = finished_run(tiny_task, out, runs_tmp, "colo", *COLOCATED)
    assert d.proc.returncode == 0, d.output()[-5000:]
    return out / "colo"


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_colocated_fixed_lag_gives_the_disaggregated_metrics(apart, colocated):
    """Colocated (release, reload, train, resume weights, update from tensors, offload, resume KV) equals
    disaggregated within the fixed-lag resume equality's tolerance; every phase timed in every row and in the
    trace; the sample identity holds."""
    a, b = step_rows(apart), step_rows(colocated)
    assert [r["step"] for r in b] == [1, 2, 3] and [r["staleness/max"] for r in b] == [0, 2, 2]
    equal(a, b)
    for r in b:
        assert all(r[k] >= 0 for k in PHASES), r
        assert r["weight_sync/num_tensors"] > 0 and r["weight_sync/bytes"] > 0
        assert r["samples/generated"] == r["samples/consumed"] + r["samples/dropped"] + r["samples/pending"]
    assert not any(k.startswith("time/colocate/") for r in a for k in r)
    placed = json.loads((colocated / "placement.json").read_text())
    assert placed["rollout"][0]["colocated_with_ranks"] == [0]
    events = json.loads((colocated / "trace.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    spans = {e["name"] for e in events if e.get("cat") == "colocate"}
    assert {"release", "reload", "resume_weights", "offload", "resume_kv"} <= spans


def health_generate(run: Path) -> int:
    """The engine's answer to a one-token generation: 200 while it holds its memory, 503 while released."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a local server: never a proxy
    try:
        with direct.open(f"{placement(run, 'rollout')[0]['url']}/health_generate", timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def sigterm_inside(d: Driver, hold: Path, run: Path, rows: int, engine: int) -> None:
    """The driver is blocked on the held swap call: check where it stands (`rows` steps logged, the engine's
    /health_generate answering `engine`), SIGTERM, wait until the driver says it got it, let the call go on.
    The signal lands in the phase the hold names, whatever the machine's speed."""
    d.wait_for("the held swap call", lambda: (hold / "held").exists(), run_dir=run)
    assert len(step_rows(run)) == rows and health_generate(run) == engine
    d.signal(signal.SIGTERM)
    d.wait_for("the SIGTERM to be acknowledged", lambda: "will checkpoint and stop" in d.output(), run_dir=run)
    (hold / "go").touch()


@pytest.mark.timeout(5 * RUN_TIMEOUT)
def test_sigterm_inside_a_swap_checkpoints_and_the_colocated_fixed_lag_run_resumes_exactly(
        tiny_task, tmp_path, short_tmp, drivers, colocated):
    """Two signals, each at a known point, each honoured after its step with a checkpoint (a swap around the
    save), each resumed; the whole equals the uninterrupted colocated run step by step.
    1. At the end of step 1's generation phase: the batch is generated and the engine still holds its memory
       (its first release is held), the trainer is offloaded.
    2. In the trainer's phase of step 2: the trainer has trained and holds the GPU, the engine is released
       (the resume of its weights, the resumed run's third resume call, is held)."""
    run, args = tmp_path / "cut", small(tiny_task, tmp_path, "cut", *COLOCATED)

    def start(name: str, *extra: str, hold: str) -> tuple[Driver, Path]:
        where = tmp_path / f"hold-{name}"
        where.mkdir()
        d = Driver(["tiny-cpu", *extra, *args], tmp_path / f"{name}.log", short_tmp,
                   env={"M2PO_CPU_SERVER_HOLD": f"{hold}:{where}"})
        drivers.append(d)
        return d, where

    d, hold = start("gen", hold="release_memory_occupation:1")
    sigterm_inside(d, hold, run, rows=0, engine=200)
    assert d.finish() == 0, d.output()[-5000:]
    assert "stopped by SIGTERM at step 1/3" in d.output() and checkpoints(run) == [1]
    assert_nothing_left(d, [rollout_port(run)])

    d, hold = start("train", "--resume", "auto", hold="resume_memory_occupation:3")
    sigterm_inside(d, hold, run, rows=1, engine=503)
    assert d.finish() == 0, d.output()[-5000:]
    assert "(step 1)" in d.output() and "stopped by SIGTERM at step 2/3" in d.output()
    assert checkpoints(run) == [1, 2]
    assert_nothing_left(d, [rollout_port(run)])

    d = Driver(["tiny-cpu", "--resume", "auto", *args], tmp_path / "done.log", short_tmp)
    drivers.append(d)
    assert d.finish() == 0, d.output()[-5000:]
    assert "(step 2)" in d.output()
    assert_nothing_left(d, [rollout_port(run)])
    assert_steps_once(run, [1, 2, 3])
    resumed = step_rows(run)
    assert_accounting(resumed)
    equal(step_rows(colocated), resumed)  # the fixed-lag queue came back with each checkpoint


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_a_failed_swap_stops_the_run_with_a_run_error_and_leaves_nothing(tiny_task, tmp_path, short_tmp, drivers,
                                                                         colocated):
    """The engine refuses the loop's resume of its KV cache in step 2 (the 10th resume call: with behaviour
    log-probs from the trainer, step 1 swaps three times, for its two generated batches and its training, and
    step 2 twice). The run stops there with the RunError naming the phase, exit 1, and nothing of it is left.
    Step 1, with the trainer's swaps of its own, generated what the engine-log-prob run generated."""
    run = tmp_path / "bad"
    d = Driver(["tiny-cpu", *small(tiny_task, tmp_path, "bad", *COLOCATED, "staleness.behav_logprob_source=trainer")],
               tmp_path / "bad.log", short_tmp, env={"M2PO_CPU_SERVER_FAIL": "resume_memory_occupation:10"})
    drivers.append(d)
    rc = d.finish()
    out = d.output()
    assert rc == 1, out[-5000:]
    assert "the colocated swap failed at resume_kv" in out and "injected fault: call 10" in out, out[-5000:]
    assert "the run stops" in out
    assert_nothing_left(d, [rollout_port(run)])
    rows = step_rows(run)
    assert [r["step"] for r in rows] == [1]
    ref = step_rows(colocated)[0]
    for key in ("reward/mean", "response_length/mean", "samples/generated", "samples/consumed"):
        assert rows[0][key] == ref[key], (key, rows[0][key], ref[key])
