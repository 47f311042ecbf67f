"""A real 2-node Slurm cluster on this machine for the `slurm` tests (tests/slurm/local_slurm/, copied from
the project's workplace tool; its README lists the pitfalls). Installs slurm-wlm + munge with apt when
missing; skips only when that is impossible (not root, no apt, no namespaces). Stops only its own daemons."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TOOL = HERE / "local_slurm"


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "local Slurm needs root (it runs slurmd in namespaces)"
    if not Path("/usr/bin/sbatch").exists() and not shutil.which("apt-get"):
        return "Slurm is not installed and apt-get is absent"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is absent"
    return None


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """Environment (dict) with SLURM_CONF of a running 2-node cluster (nodes n1, n2). One per machine (fixed
    ports, root's daemons): `make test` runs pytest-xdist with --dist loadfile, so every test using it must stay
    in one file (test_slurm_job.py), which one worker runs."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    # not under pytest's basetemp: other pytest sessions on the machine prune old basetemps mid-run
    base = Path(os.environ.get("M2PO_TEST_SLURM_DIR") or tempfile.mkdtemp(prefix="m2po-slurm-"))
    env = dict(os.environ)
    env.update(SLURM_LOCAL_DIR=str(base), SLURM_LOCAL_NODES="2", SLURM_LOCAL_CPUS="4",
               SLURM_LOCAL_MEM_MB="8000", SLURM_LOCAL_TIMEOUT="180",  # nodes idle: slow under a loaded CI
               SLURM_LOCAL_PORT_BASE=os.environ.get("M2PO_TEST_SLURM_PORT_BASE", "15800"))
    try:
        res = subprocess.run([str(TOOL / "start-local-slurm.sh")], env=env, capture_output=True, text=True,
                             timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip("starting the local Slurm (apt-get install) took over 15 min")
    if res.returncode != 0:
        subprocess.run([str(TOOL / "stop-local-slurm.sh")], env=env, capture_output=True, timeout=180)
        if not Path("/usr/bin/sbatch").exists():
            pytest.skip(f"Slurm could not be installed: {res.stderr[-500:]}")
        if "unshare --uts --mount not permitted" in res.stderr:
            pytest.skip("this machine does not allow UTS/mount namespaces for the fake nodes")
        raise RuntimeError(f"local Slurm failed to start:\n{res.stdout}\n{res.stderr}")
    env["SLURM_CONF"] = str(base / "etc" / "slurm.conf")
    env["M2PO_HOME"] = str(REPO)
    env["RAY_AUTH_MODE"] = "disabled"
    env["M2PO_RAY_CPUS"] = "1"  # 2 real cores shared by the fake nodes
    env["M2PO_RAY_OBJECT_STORE_BYTES"] = str(100 * 1024**2)
    env["M2PO_STOP_TIMEOUT"] = "20"
    env["M2PO_RAY_START_TIMEOUT"] = "300"
    env["M2PO_TEST_JOBS_DIR"] = str(base / "jobs")
    yield env
    subprocess.run([str(TOOL / "stop-local-slurm.sh")], env=env, capture_output=True, timeout=180)
    if not os.environ.get("M2PO_TEST_SLURM_DIR"):
        shutil.rmtree(base, ignore_errors=True)


class Slurm:
    """Submit and wait with timeouts (squeue polling; never sbatch --wait)."""

    def __init__(self, env: dict):
        self.env = env

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        res = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout,
                             cwd=REPO)
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} -> {res.returncode}: {res.stderr}")
        return res

    def sbatch(self, *args: str, env: dict | None = None) -> str:
        res = subprocess.run(["sbatch", "--parsable", *args], env={**self.env, **(env or {})},
                             capture_output=True, text=True, timeout=60, cwd=REPO)
        assert res.returncode == 0, res.stderr
        return res.stdout.strip().split(";")[0]

    def active(self, job: str) -> list[str]:
        out = self.run("squeue", "-h", "-r", "-j", job, "-o", "%i %T", check=False).stdout
        return [ln for ln in out.splitlines() if ln.strip()]

    def wait_gone(self, job: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.active(job):
                return
            time.sleep(2)
        self.run("scancel", "--full", job, check=False)
        raise AssertionError(f"job {job} still active after {timeout:.0f} s: {self.active(job)}")

    def wait_for(self, predicate, timeout: float, what: str, job: str | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(1)
        if job:
            self.run("scancel", "--full", job, check=False)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")

    def nodes_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.split("\n")
        states = dict(ln.split() for ln in out if ln.strip())
        return all(s == "idle" for s in states.values()) and len(states) == 2


@pytest.fixture
def slurm(slurm_cluster):
    s = Slurm(slurm_cluster)
    # a test starts on an empty cluster (a failed earlier test may have left a job behind)
    s.run("scancel", "--full", "-u", "root", check=False)
    s.wait_for(s.nodes_idle, 90, "both nodes idle")
    return s


@pytest.fixture
def jobdir(slurm_cluster) -> Path:
    """A fresh directory for one test's runs, inside the cluster's own base dir (kept until the session
    ends; pytest's tmp_path can be pruned by another pytest session while a job still writes to it)."""
    root = Path(slurm_cluster["M2PO_TEST_JOBS_DIR"])
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=root))
