"""`m2po sweep --local` with real runs (Ray, a Megatron rank, the CPU rollout server, math-verify): two
runs of two steps at once; a second start skips both; an interrupted run resumes from its checkpoint;
`--status` reads the runner's records; `m2po report` reads the run directories. Every run is a subprocess
with a timeout."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from m2po_megatron.sweep import grid as sw
from m2po_megatron.sweep import status as sweep_status
from m2po_megatron.run.metrics import read_metrics
from m2po_megatron.sweep.local import latest_checkpoint_step, local_state

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 900


def m2po(*args: str, timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled", WANDB_MODE="disabled")
    return subprocess.run([sys.executable, "-m", "m2po_megatron.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def m2po_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """`m2po ARGS` in this process (`cli.main`), for the commands that only read run directories (status,
    report) or refuse before anything starts: a subprocess would only add its imports."""
    from m2po_megatron.cli import main

    capsys.readouterr()
    rc = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), rc, out.out, out.err)


def ok(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def swept(tiny_task, tmp_path_factory):
    """A 2-run sweep (GRPO on-policy, M2PO at lag 1) of 2 steps each, run with -j 2."""
    tmp = tmp_path_factory.mktemp("sweep-local")
    evals = tmp / "tiny_eval.jsonl"
    evals.write_text("\n".join((tiny_task / "eval.jsonl").read_text().splitlines()[:8]) + "\n")
    out = tmp / "out"
    spec = {
        "name": "t", "output_dir": str(out), "recipe": "tiny-cpu",
        "overrides": [f"model.hf_path={tiny_task}", f"data.train_path={tiny_task / 'train.jsonl'}",
                      f"data.eval_paths=[{evals}]", "parallel.tensor_model_parallel_size=1", "rollout.host=null",
                      "train.steps=2", "train.prompts_per_step=4", "train.updates_per_step=2",
                      "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=16", "eval.interval=2",
                      "eval.n_samples=2", "checkpoint.interval=1", "checkpoint.keep_last=2", "reward.num_workers=1"],
        "grid": {"method": {"grpo": ["algo.name=grpo", "staleness.mode=on_policy"],
                            "m2po": ["algo.name=m2po", "staleness.mode=fixed_lag", "staleness.lag_steps=1"]}},
    }
    path = tmp / "t.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    first = ok(m2po("sweep", str(path), "--local", "-j", "2"))
    return path, out, first


@pytest.mark.timeout(3 * TIMEOUT)
def test_local_sweep_runs_every_run_in_its_slurm_directory(swept):
    path, out, stdout = swept
    assert "2 of 2 runs to do, 2 at a time" in stdout and "2/2 finished" in stdout
    names = [r.name for r in sw.expand(sw.load_sweep(path))]
    assert names == ["t-grpo", "t-m2po"]
    for name in names:  # the directories Slurm would use: output_dir/<run name>
        run = out / name
        assert local_state(run, 2) == "COMPLETED" and latest_checkpoint_step(run) == 2
        rows = [r for r in read_metrics(run / "metrics.jsonl") if "samples/generated" in r]
        assert [r["step"] for r in rows] == [1, 2]
        record = (run / "logs" / "job-state").read_text().split()
        assert record[0] == "START" and record[1].startswith("job=local:") and record[-1] == "rc=0"
        assert "[m2po] run directory" in (run / "logs" / "local.log").read_text()
    assert [r["staleness/max"] for r in read_metrics(out / "t-m2po" / "metrics.jsonl") if "staleness/max" in r] \
        == [0, 2]  # lag 1 x 2 updates per step: the second step trains on data one step old


@pytest.mark.timeout(3 * TIMEOUT)
def test_a_second_start_skips_finished_runs_and_resumes_an_interrupted_one(swept):
    path, out, _ = swept
    before = {n: (out / n / "metrics.jsonl").read_text() for n in ("t-grpo", "t-m2po")}
    again = ok(m2po("sweep", str(path), "--local"))
    assert "skip t-grpo: finished" in again and "skip t-m2po: finished" in again
    assert "0 of 2 runs to do" in again
    assert {n: (out / n / "metrics.jsonl").read_text() for n in before} == before

    # What a runner killed during step 2 of t-m2po leaves: the step-1 checkpoint, metrics up to step 1, and
    # a START record whose process is gone.
    run = out / "t-m2po"
    shutil.rmtree(run / "checkpoints" / "step_0000002")
    kept = [line for line in (run / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 1]
    (run / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)
    with open(run / "logs" / "job-state", "a") as f:
        f.write(f"START job=local:{gone.pid} host={socket.gethostname()} {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
    status = {r["run"]: r for r in sweep_status.status(path)}
    assert status["t-m2po"]["state"] == "INTERRUPTED" and status["t-m2po"]["metrics"]["step"] == 1
    assert status["t-grpo"]["state"] == "COMPLETED"

    resumed = ok(m2po("sweep", str(path), "--local"))
    assert "skip t-grpo: finished" in resumed and "1 of 2 runs to do" in resumed
    assert "start t-m2po (resuming from step 1)" in resumed and "2/2 finished" in resumed
    assert local_state(run, 2) == "COMPLETED"
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "samples/generated" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["version"] == 4


@pytest.mark.timeout(3 * TIMEOUT)
def test_status_cli_for_a_local_sweep(swept, capsys):
    path, out, _ = swept
    text = ok(m2po_here(capsys, "sweep", str(path), "--status"))
    lines = {ln.split()[0]: ln for ln in text.splitlines() if ln.strip()}
    assert "COMPLETED" in lines["t-grpo"] and "step 2/2" in lines["t-grpo"] and "local" in lines["t-grpo"]
    rows = json.loads(ok(m2po_here(capsys, "sweep", "status", str(out), "--json")))
    assert {r["run"]: r["state"] for r in rows} == {"t-grpo": "COMPLETED", "t-m2po": "COMPLETED"}


@pytest.mark.timeout(3 * TIMEOUT)
def test_report_reads_the_real_run_directories(swept, tmp_path, capsys):
    _, out, _ = swept
    text = ok(m2po_here(capsys, "report", str(out), "--out", str(tmp_path / "r")))
    assert "| GRPO | 0 |" in text and "| M2PO | 2 |" in text  # staleness: lag 1 x 2 updates per step
    csv_lines = (tmp_path / "r" / "report.csv").read_text().splitlines()
    assert csv_lines[0].startswith("model,method,staleness,variant,eval,benchmark,mean,std,n")
    cells = [ln.split(",") for ln in csv_lines[1:]]
    assert {(c[1], c[4], c[5]) for c in cells} == {(m, w, b) for m in ("grpo", "m2po")
                                                  for w in ("score", "last", "best") for b in ("tiny_eval", "avg")}
    assert all(c[8] == "1" for c in cells)  # one run behind each cell
    for png in ("curves.png", "diagnostics.png"):
        assert (tmp_path / "r" / png).stat().st_size > 10_000


def test_parallel_runs_on_fixed_ports_are_refused_before_anything_starts(tiny_task, tmp_path, capsys):
    spec = {"name": "p", "output_dir": str(tmp_path / "o"), "recipe": "tiny-cpu",
            "overrides": [f"model.hf_path={tiny_task}", f"data.train_path={tiny_task / 'train.jsonl'}",
                          "data.eval_paths=[]", "rollout.port=30000"],
            "grid": {"m": {"a": ["algo.name=grpo"], "b": ["algo.name=m2po"]}}}
    path = tmp_path / "p.yaml"
    path.write_text(json.dumps(spec))
    p = m2po_here(capsys, "sweep", str(path), "--local", "-j", "2")
    assert p.returncode == 2 and "rollout.port=0" in p.stderr, p.stderr
    assert not (tmp_path / "o").exists()
    dry = m2po("sweep", str(path), "--local", "--dry-run", timeout=300)
    assert dry.returncode == 0, dry.stderr
    assert "DRY-RUN p-a [PENDING]" in dry.stdout and "--resume auto" in dry.stdout


@pytest.mark.timeout(3 * TIMEOUT)
def test_archived_runs_count_as_finished_without_their_checkpoints(swept, tmp_path, capsys):
    """What a results directory in git holds (tools/archive_runs.py and its .gitignore): config.yaml,
    metrics.jsonl.gz and the job-state record; a sweep started on another machine skips those runs, and the
    report reads them."""
    path, out, _ = swept
    spec = json.loads(path.read_text())
    spec["output_dir"] = str(tmp_path / "kept")
    for name in ("t-grpo", "t-m2po"):
        dst = tmp_path / "kept" / name
        (dst / "logs").mkdir(parents=True)
        for f in ("config.yaml", "metrics.jsonl", "logs/job-state"):
            shutil.copy(out / name / f, dst / f)
    unfinished = tmp_path / "kept" / "t-m2po" / "metrics.jsonl"
    full = unfinished.read_text()
    unfinished.write_text("\n".join(ln for ln in full.splitlines() if json.loads(ln)["step"] <= 1) + "\n")
    archive = [sys.executable, str(REPO / "tools" / "archive_runs.py"), str(tmp_path / "kept")]
    p = subprocess.run(archive, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "1 of 2 runs finished and archived" in p.stdout, p.stdout + p.stderr
    assert not (tmp_path / "kept" / "t-m2po" / "metrics.jsonl.gz").exists()  # stopped at step 1 of 2
    unfinished.write_text(full)
    p = subprocess.run(archive, capture_output=True, text=True, timeout=120)
    assert "2 of 2 runs finished and archived" in p.stdout, p.stdout + p.stderr
    for name in ("t-grpo", "t-m2po"):
        run = tmp_path / "kept" / name
        plain = read_metrics(run / "metrics.jsonl")
        (run / "metrics.jsonl").unlink()
        assert read_metrics(run / "metrics.jsonl.gz") == plain
        assert local_state(run, 2) == "COMPLETED" and latest_checkpoint_step(run) == 0
    moved = tmp_path / "kept.yaml"
    moved.write_text(json.dumps(spec))
    again = ok(m2po("sweep", str(moved), "--local"))
    assert "skip t-grpo: finished" in again and "skip t-m2po: finished" in again and "0 of 2 runs to do" in again
    text = ok(m2po_here(capsys, "report", str(tmp_path / "kept"), "--out", str(tmp_path / "r"), "--no-plots"))
    assert "| GRPO | 0 |" in text and "| M2PO | 2 |" in text
