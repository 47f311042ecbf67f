"""Real driver processes for the fault-injection tests: start `m2po train`, wait for observable events
(rows in metrics.jsonl, lines in its output, files appearing), inject faults, and check what is left.

Every driver runs with its own TMPDIR (so its private Ray temp dir is known) and a tag in its environment
(inherited by everything it starts); `leftovers()` finds the run's processes by either, so a test can
assert that nothing of a run survives it, and teardown kills whatever a failed test left."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

from m2po_megatron.run.metrics import read_metrics

RUN_TIMEOUT = 600  # a failure deadline for one driver on a loaded 2-core machine, never a wait


def small(task: Path, out: Path, name: str, *extra: str) -> list[str]:
    """The tiny task, one trainer rank, short steps: the cheapest real run of the whole pipeline."""
    return [f"model.hf_path={task}", f"data.train_path={task / 'train.jsonl'}", "data.eval_paths=[]",
            f"run.output_dir={out}", f"run.name={name}", "train.prompts_per_step=4", "train.updates_per_step=2",
            "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=16", "eval.interval=0",
            "checkpoint.interval=1", "checkpoint.keep_last=100", "reward.num_workers=1",
            "parallel.tensor_model_parallel_size=1", *extra]


def step_rows(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [r for r in read_metrics(path) if "samples/generated" in r] if path.exists() else []


def assert_accounting(rows: list[dict]) -> None:
    """The identity on every row, and no counter going backwards across interruptions and resumes."""
    for r in rows:
        assert r["samples/generated"] == r["samples/consumed"] + r["samples/dropped"] + r["samples/pending"], r
        assert r["samples/dropped"] == sum(v for k, v in r.items() if k.startswith("samples/dropped/")), r
    for a, b in zip(rows, rows[1:]):
        for k in ("samples/generated", "samples/consumed", "samples/dropped"):
            assert b[k] >= a[k], (k, a["step"], a[k], b["step"], b[k])


def assert_steps_once(run_dir: Path, steps: list[int]) -> None:
    got = [r["step"] for r in step_rows(run_dir)]
    assert got == steps, f"metrics.jsonl steps {got}, expected {steps} (each once, in order)"


def checkpoints(run_dir: Path) -> list[int]:
    root = Path(run_dir) / "checkpoints"
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit() and (p / "COMPLETE").exists())


def assert_checkpoints_intact(run_dir: Path) -> None:
    """Every step_XXXXXXX directory is complete and matches its manifest (a write cut short stays a
    .tmp directory, which resume ignores)."""
    from m2po_megatron.run.state import CheckpointManager

    mgr = CheckpointManager(Path(run_dir) / "checkpoints")
    dirs = [p for p in mgr.root.glob("step_*") if p.name[5:].isdigit()]
    assert all((p / "COMPLETE").is_file() for p in dirs), [p.name for p in dirs]
    assert all(not mgr.verify(p) for p in dirs), {p.name: mgr.verify(p) for p in dirs}


def run_tail(run_dir: Path | None, lines: int = 30) -> str:
    """What a failed wait needs beyond the driver's output: the last metrics row and each rollout server's
    log tail."""
    if run_dir is None:
        return ""
    rows = step_rows(run_dir)
    out = [f"\n--- last metrics row: {rows[-1] if rows else None}"]
    for log in sorted((Path(run_dir) / "rollout").glob("*.log")):
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        out.append(f"--- {log.name}:\n{tail}")
    return "\n".join(out)


class Driver:
    """One `m2po train` process. `tmp_root`: a short directory (Ray's socket paths must fit 107 bytes)."""

    def __init__(self, args: list[str], log: Path, tmp_root: Path, command: str = "train",
                 env: Optional[dict] = None):
        """`env`: added to the driver's environment, which everything of the run inherits (the CPU server's
        fault injection, rollout/server_memory.py InjectedFaults, is set this way)."""
        self.tag = uuid.uuid4().hex
        self.tmpdir = Path(tempfile.mkdtemp(prefix="t", dir=tmp_root))
        env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled", WANDB_MODE="disabled",
                   M2PO_FAULT_TAG=self.tag, TMPDIR=str(self.tmpdir), **(env or {}))
        self.log_path = log
        self._log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "m2po_megatron.cli", command, *args], env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, what: str, ready: Callable[[], bool], timeout: float = RUN_TIMEOUT,
                 run_dir: Path | None = None) -> None:
        """Until `ready()` (an observable event); the deadline is only a failure timeout. A failure shows the
        driver's output and, given `run_dir`, the last metrics row and the rollout servers' log tails."""
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, f"the driver exited ({self.proc.returncode}) before {what}:\n" \
                                             f"{self.output()[-6000:]}{run_tail(run_dir)}"
            assert time.monotonic() < deadline, f"no {what} within {timeout} s:\n{self.output()[-6000:]}" \
                                                f"{run_tail(run_dir)}"
            time.sleep(0.5)

    def wait_rows(self, run_dir: Path, n: int) -> list[dict]:
        self.wait_for(f"{n} metrics rows", lambda: len(step_rows(run_dir)) >= n, run_dir=run_dir)
        return step_rows(run_dir)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def finish(self, timeout: float = RUN_TIMEOUT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.close()

    def cleanup(self) -> None:
        """Teardown: whatever a failed test left of this run goes."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)
        for pid in leftovers(self.tag, self.tmpdir):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self._log.close()


def leftovers(tag: str, tmpdir: Path) -> list[int]:
    """Processes of this user carrying the run's tag in their environment, or holding a file under its
    TMPDIR (Ray's agents overwrite their environment with their process title)."""
    needle = f"M2PO_FAULT_TAG={tag}\0".encode()
    prefix = os.path.realpath(tmpdir) + os.sep
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != os.getuid():
                continue
            stat = Path(f"/proc/{name}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                continue
            hit = needle in Path(f"/proc/{name}/environ").read_bytes()
            if not hit:
                for fd in os.listdir(f"/proc/{name}/fd"):
                    try:
                        if os.readlink(f"/proc/{name}/fd/{fd}").startswith(prefix):
                            hit = True
                            break
                    except OSError:
                        continue
        except OSError:
            continue
        if hit:
            out.append(int(name))
    return out


def assert_nothing_left(driver: Driver, ports: list[int] = (), timeout: float = 120) -> None:
    """No process of the run and none of its ports survive it (a deadline only for the kernel to reap)."""
    deadline = time.monotonic() + timeout
    while (left := leftovers(driver.tag, driver.tmpdir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    desc = {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:120] for p in left
            if Path(f"/proc/{p}/cmdline").exists()}
    assert not left, f"processes of the run still up: {desc}"
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))  # raises if anything still listens there
    stale = [p.name for p in driver.tmpdir.glob("m2po-ray-*")]
    assert not stale, f"private Ray temp dirs left in {driver.tmpdir}: {stale}"


def rollout_port(run_dir: Path) -> int:
    url = json.loads((Path(run_dir) / "placement.json").read_text())["rollout"][0]["url"]
    return int(url.rsplit(":", 1)[1])


def placement(run_dir: Path, role: str) -> list[dict]:
    return json.loads((Path(run_dir) / "placement.json").read_text())[role]


def m2po(*args: str, timeout: float = 300, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled", WANDB_MODE="disabled", **(env or {}))
    return subprocess.run([sys.executable, "-m", "m2po_megatron.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
