"""slurm/m2po.sbatch and `m2po sweep` on a real 2-node Slurm (started by conftest.py).

Each job starts a real Ray cluster across the fake nodes n1 and n2; on 2 shared cores one job takes
about a minute, so every wait has a generous timeout and every test cancels what it started."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[2]
RECIPE = "tests/slurm/recipes/two-node.yaml"
PLACEMENT = "exec $M2PO_PYTHON $M2PO_HOME/slurm/ray_check.py placement $RAY_ADDRESS"
JOB_TIMEOUT = 420  # Ray takes 1-3 min to start on 2 loaded cores


def _read(p: Path) -> str:
    return p.read_text() if p.exists() else ""


def _states(run_dir: Path) -> list[str]:
    return [ln.split()[0] for ln in _read(run_dir / "logs" / "job-state").splitlines() if ln.strip()]


@pytest.mark.timeout(JOB_TIMEOUT + 120)
def test_disaggregated_job_places_trainer_and_rollout_on_separate_nodes(slurm, jobdir):
    run_dir = jobdir / "two-node"
    job = slurm.sbatch("-N2", f"--output={jobdir}/slurm-%j.out", str(REPO / "slurm/m2po.sbatch"), RECIPE,
                       f"run.output_dir={jobdir}", env={"M2PO_DRIVER_CMD": PLACEMENT})
    slurm.wait_gone(job, JOB_TIMEOUT)
    driver = _read(run_dir / "logs" / "driver.log")
    joblog = _read(run_dir / "logs" / "job.log")
    assert "role=trainer node=n1" in driver, joblog + driver
    assert "role=rollout node=n2" in driver, joblog + driver
    assert "role=trainer node=n2" not in driver and "role=rollout node=n1" not in driver
    assert "disaggregated on 2 nodes: trainer=[n1] rollout=[n2]" in joblog
    assert _states(run_dir) == ["START", "EXIT"]
    assert _read(run_dir / "logs" / "job-state").strip().endswith("rc=0")
    assert (run_dir / "logs" / "ray-head-n1.log").exists() and (run_dir / "logs" / "ray-worker-n2.log").exists()
    slurm.wait_for(slurm.nodes_idle, 60, "nodes released")


@pytest.mark.timeout(JOB_TIMEOUT + 120)
def test_a_dead_ray_node_ends_the_job_nonzero_and_frees_the_nodes(slurm, jobdir):
    run_dir = jobdir / "two-node"
    hold = "echo driver-up; exec sleep 600"
    job = slurm.sbatch("-N2", f"--output={jobdir}/slurm-%j.out", str(REPO / "slurm/m2po.sbatch"), RECIPE,
                       f"run.output_dir={jobdir}", env={"M2PO_DRIVER_CMD": hold})
    slurm.wait_for(lambda: "driver-up" in _read(run_dir / "logs" / "driver.log"), JOB_TIMEOUT,
                   "the driver to start", job)
    # the raylet of this job's worker node n2: its command line names the job's node-local temp dir
    marker = f"m2po-ray-{job}/n2"
    victims = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "raylet" in cmd.split(" ")[0] and marker in cmd:
            victims.append(int(pid))
    assert victims, f"no raylet of job {job} on n2 found"
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    slurm.wait_gone(job, 120)
    joblog = _read(run_dir / "logs" / "job.log")
    assert "ray workers (n2) exited" in joblog, joblog
    last = _read(run_dir / "logs" / "job-state").strip().splitlines()[-1]
    assert last.startswith("EXIT") and not last.endswith("rc=0"), last
    slurm.wait_for(slurm.nodes_idle, 60, "nodes released after the failure")


@pytest.mark.timeout(2 * JOB_TIMEOUT + 120)
def test_usr1_checkpoints_requeues_and_resumes(slurm, jobdir):
    run_dir = jobdir / "two-node"
    driver = (
        'if [ -f "$M2PO_RUN_DIR/ckpt" ]; then echo "resumed from $(cat $M2PO_RUN_DIR/ckpt)"; exit 0; fi; '
        'trap \'echo step-7 > "$M2PO_RUN_DIR/ckpt"; echo checkpointed; exit 0\' USR1; '
        'echo waiting; while :; do sleep 1; done'
    )
    job = slurm.sbatch("-N2", f"--output={jobdir}/slurm-%j.out", str(REPO / "slurm/m2po.sbatch"), RECIPE,
                       f"run.output_dir={jobdir}", env={"M2PO_DRIVER_CMD": driver})
    log = run_dir / "logs" / "driver.log"
    slurm.wait_for(lambda: "waiting" in _read(log), JOB_TIMEOUT, "the driver to start", job)
    slurm.run("scancel", "-b", "-s", "USR1", job)  # what --signal=B:USR1@N does near the time limit
    slurm.wait_for(lambda: "resumed from step-7" in _read(log), JOB_TIMEOUT, "the requeued job to resume", job)
    slurm.wait_gone(job, 120)
    assert "checkpointed" in _read(log)
    assert _states(run_dir) == ["START", "REQUEUED", "START", "EXIT"], _read(run_dir / "logs" / "job-state")
    assert "restart=1" in _read(run_dir / "logs" / "job-state")
    assert _read(run_dir / "logs" / "job-state").strip().endswith("rc=0")


@pytest.mark.timeout(2 * JOB_TIMEOUT + 120)
def test_sweep_array_completes_and_status_reports_it(slurm, jobdir, tiny_task):
    """Two real (one-step) training runs of the tiny recipe as one job array, colocated on one node each."""
    sweep = jobdir / "tiny.yaml"
    sweep.write_text(f"""
name: tiny
output_dir: {jobdir}/sweep
overrides: [cluster.rollout_nodes=0, train.steps=1, train.prompts_per_step=4, rollout.n_samples_per_prompt=4,
            "model.hf_path={tiny_task}", "data.train_path={tiny_task / 'train.jsonl'}", "data.eval_paths=[]"]
grid:
  model:
    m: {{recipe: {REPO / "recipes" / "tiny-cpu.yaml"}}}
  method:
    grpo: [algo.name=grpo]
    m2po: [algo.name=m2po, algo.m2po.tau=0.02]
slurm:
  max_concurrent: 2
""")
    env = {**slurm.env, "M2PO_DRIVER_CMD": ""}
    cli = [sys.executable, "-m", "m2po_megatron.cli", "sweep"]
    res = subprocess.run([*cli, str(sweep)], env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "--array=0-1%2" in res.stdout
    manifest = json.loads((jobdir / "sweep" / "sweep-manifest.json").read_text())
    array_id = manifest["submissions"][0]["job_id"]
    assert [r["jobs"] for r in manifest["runs"]] == [[f"{array_id}_0"], [f"{array_id}_1"]]
    slurm.wait_gone(array_id, 2 * JOB_TIMEOUT)
    res = subprocess.run([*cli, "status", str(sweep), "--json"], env=env, capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr
    rows = {r["run"]: r for r in json.loads(res.stdout)}
    assert set(rows) == {"tiny-m-grpo", "tiny-m-m2po"}
    for name, row in rows.items():
        driver = _read(Path(row["run_dir"]) / "logs" / "driver.log")
        assert row["state"] == "COMPLETED", (row, driver[-3000:])
        assert row["metrics"]["step"] == 1 and "reward/mean" in row["metrics"], row
        assert re.search(r"role=trainer\b.*?node=(n\d)", driver).group(1) == \
            re.search(r"role=rollout\b.*?node=(n\d)", driver).group(1)  # colocated: one node, both roles
    cfg = {name: _read(Path(row["run_dir"]) / "config.yaml") for name, row in rows.items()}
    assert "name: grpo" in cfg["tiny-m-grpo"] and "tau: 0.02" in cfg["tiny-m-m2po"]
    config_dirs = {json.dumps(r["overrides"]) for r in manifest["runs"]}
    assert len(config_dirs) == 2


@pytest.mark.timeout(JOB_TIMEOUT + 300)
def test_tiny_cpu_recipe_trains_across_two_nodes_and_sigterm_checkpoints_under_srun(slurm, jobdir, tiny_task):
    """The real `m2po train recipes/tiny-cpu.yaml` through the job script: trainer on n1, rollout server on
    n2 (from the `[placement] role=... node=...` lines the training loop logs). After its first step the
    batch script gets SIGTERM (`scancel -b -s TERM`, as an operator stopping a job would), forwards it to
    the driver's srun step, and the driver checkpoints after the step and exits 0: the job ends with rc=0."""
    run_dir = jobdir / "tiny-e2e"
    job = slurm.sbatch("-N2", f"--output={jobdir}/slurm-%j.out", str(REPO / "slurm/m2po.sbatch"),
                       "recipes/tiny-cpu.yaml", "train.steps=20", "cluster.trainer_nodes=1", "checkpoint.interval=0",
                       f"model.hf_path={tiny_task}", f"data.train_path={tiny_task / 'train.jsonl'}",
                       "data.eval_paths=[]", "train.prompts_per_step=8", "rollout.n_samples_per_prompt=4",
                       "cluster.rollout_nodes=1", "rollout.host=null", f"run.output_dir={jobdir}", "run.name=tiny-e2e",
                       env={"M2PO_DRIVER_CMD": ""})
    slurm.wait_for(lambda: '"step": 1' in _read(run_dir / "metrics.jsonl"), JOB_TIMEOUT, "the first step", job)
    slurm.run("scancel", "-b", "-s", "TERM", job)
    slurm.wait_gone(job, JOB_TIMEOUT)
    logs = "".join(_read(p) for p in sorted((run_dir / "logs").glob("*.log")))
    assert _read(run_dir / "logs" / "job-state").strip().endswith("rc=0"), logs[-3000:]
    assert re.search(r"role=trainer\b.*node=n1\b", logs), logs[-3000:]
    assert re.search(r"role=rollout\b.*node=n2\b", logs), logs[-3000:]
    driver = _read(run_dir / "logs" / "driver.log")
    assert "received SIGTERM; will checkpoint and stop after the current step" in driver, logs[-3000:]
    stopped = re.search(r"stopped by SIGTERM at step (\d+)/20", driver)
    assert stopped, driver[-3000:]
    step = int(stopped.group(1))
    assert 1 <= step < 20 and (run_dir / "checkpoints" / f"step_{step:07d}" / "COMPLETE").exists()
    assert _states(run_dir) == ["START", "EXIT"]  # TERM (unlike USR1) is not requeued
    slurm.wait_for(slurm.nodes_idle, 60, "nodes released")
