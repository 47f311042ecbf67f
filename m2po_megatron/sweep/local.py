"""`m2po sweep SWEEP.yaml --local [-j N]`: a sweep's runs on this machine, N at a time.

The runs, their names and directories are the ones `m2po sweep` submits to Slurm (sweep.expand); each is
`m2po train RECIPE OVERRIDES... --resume auto` in a child process, as m2po.sbatch runs it, so a run stopped
for any reason continues from its latest checkpoint when the sweep is started again, and a finished run
(it exited 0 with its checkpoint at train.steps) is skipped. Each run's record is the file Slurm jobs write
too, RUN_DIR/logs/job-state (START / EXIT lines; `job=local:PID`), so `m2po sweep --status` reads local
and Slurm runs alike; its console output goes to RUN_DIR/logs/local.log.
"""
from __future__ import annotations

import fcntl
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TextIO

from m2po_megatron.sweep.grid import (MANIFEST, REPO, Run, SweepError, expand, last_metrics, load_sweep,
                                 sweep_output_dir)

LOCAL_LOG = "local.log"


@dataclass
class LocalRun:
    run: Run
    steps: int  # train.steps of the resolved config
    proc: Optional[subprocess.Popen] = None
    log: Optional[TextIO] = None
    t0: float = 0.0

    @property
    def run_dir(self) -> Path:
        return Path(self.run.run_dir)


def _state_lines(run_dir: Path) -> list[list[str]]:
    f = run_dir / "logs" / "job-state"
    if not f.is_file():
        return []
    return [ln.split() for ln in f.read_text().splitlines() if ln.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def latest_checkpoint_step(run_dir: Path) -> int:
    """The step of the run's latest complete checkpoint (0 if none)."""
    from m2po_megatron.run.state import CheckpointManager

    steps = CheckpointManager(run_dir / "checkpoints", keep_last=0).complete_steps()
    return steps[-1] if steps else 0


def _last_step(run_dir: Path) -> int:
    """The last step its metrics record: a finished run committed without its checkpoints (archived on
    another machine) is finished here too."""
    from m2po_megatron.sweep.grid import last_metrics

    row = last_metrics(run_dir)
    return int(row["step"]) if row else 0


def local_state(run_dir: Path, steps: int) -> str:
    """COMPLETED | RUNNING | INTERRUPTED (its process is gone without an EXIT record) | STOPPED (exited 0
    before train.steps, e.g. on SIGTERM) | FAILED(rc=N) | PENDING (never started)."""
    lines = _state_lines(run_dir)
    if not lines:
        return "PENDING"
    last = lines[-1]
    job = next((w.split("=", 1)[1] for w in last if w.startswith("job=")), "")
    if last[0] == "START":
        same_host = any(w == f"host={socket.gethostname()}" for w in last)
        if job.startswith("local:") and same_host and _pid_alive(int(job.split(":")[1])):
            return "RUNNING"
        return "INTERRUPTED"
    if last[0] == "EXIT":
        rc = last[-1].split("=")[-1]
        if rc != "0":
            return f"FAILED(rc={rc})"
        return "COMPLETED" if max(latest_checkpoint_step(run_dir), _last_step(run_dir)) >= steps else "STOPPED"
    return last[0]


def _record(run_dir: Path, line: str) -> None:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "job-state", "a") as f:
        f.write(line + "\n")


def _prepare(runs: list[Run], parallel: int) -> list[LocalRun]:
    """Validate every run (files included: they are needed on this machine) before starting any; all
    errors at once."""
    from m2po_megatron.config import ConfigError, load_config

    out, errors = [], []
    for r in runs:
        try:
            cfg = load_config(_recipe_path(r.recipe), r.overrides)
        except ConfigError as e:
            errors.append(f"run {r.name} ({r.recipe}): {e}")
            continue
        if parallel > 1 and cfg.rollout.port and not cfg.rollout.urls:
            errors.append(f"run {r.name}: rollout.port = {cfg.rollout.port} is a fixed port, so runs started "
                          f"together would collide; add rollout.port=0 to the sweep's overrides (each server "
                          f"binds a free port) or run with -j 1")
        out.append(LocalRun(r, int(cfg.train.steps)))
    if errors:
        raise SweepError("invalid runs:\n" + "\n".join(errors))
    return out


def _recipe_path(recipe: str) -> str:
    p = Path(recipe)
    return str(p if p.is_absolute() else REPO / p)  # expand() names recipes relative to the repository


def _command(r: Run) -> list[str]:
    return [sys.executable, "-m", "m2po_megatron.cli", "train", _recipe_path(r.recipe), *r.overrides,
            "--resume", "auto"]


def _write_manifest(sweep: dict, sweep_path: str | Path, out_dir: Path, lruns: list[LocalRun],
                    parallel: int) -> None:
    manifest = {
        "sweep": str(sweep.get("name") or Path(sweep_path).stem),
        "sweep_file": str(Path(sweep_path).resolve()),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "mode": "local",
        "parallel": parallel,
        "output_dir": str(out_dir),
        "runs": [{"name": lr.run.name, "recipe": lr.run.recipe, "overrides": lr.run.overrides,
                  "run_dir": str(lr.run_dir), "axes": lr.run.axes, "steps": lr.steps, "jobs": []}
                 for lr in lruns],
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _progress_line(done: int, total: int, running: list[LocalRun], durations: list[float], t_start: float,
                   waiting: int, parallel: int) -> str:
    parts = []
    for lr in running:
        m = last_metrics(lr.run_dir) or {}
        parts.append(f"{lr.run.name} step {m.get('step', 0)}/{lr.steps}")
    now = time.monotonic()
    eta = ""
    if durations:  # the mean duration of a finished run, for the waiting ones and the rest of the running ones
        per_run = sum(durations) / len(durations)
        work = per_run * waiting + sum(max(0.0, per_run - (now - lr.t0)) for lr in running)
        eta = f", eta ~{_hms(work / parallel)}"
    elapsed = now - t_start
    return (f"[sweep] {done}/{total} finished, {len(running)} running ({'; '.join(parts) or '-'}), elapsed "
            f"{_hms(elapsed)}{eta}")


def _hms(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def run_local(sweep_path: str | Path, parallel: int = 1, out=None, poll_s: float = 2.0,
              report_every_s: float = 60.0, dry_run: bool = False) -> int:
    """Run the sweep's unfinished runs here, `parallel` at a time (dry_run: print each run's state and
    command). Returns the number of runs that are not finished (0 = all finished)."""
    out = out or sys.stdout  # read at call time: a default bound at import keeps a replaced stdout
    if parallel < 1:
        raise SweepError(f"-j {parallel}: give at least 1 run at a time")
    sweep = load_sweep(sweep_path)
    runs = expand(sweep)
    out_dir = sweep_output_dir(sweep, sweep_path)
    lruns = _prepare(runs, parallel)
    if dry_run:
        for lr in lruns:
            print(f"DRY-RUN {lr.run.name} [{local_state(lr.run_dir, lr.steps)}]: {shlex.join(_command(lr.run))}",
                  file=out)
        return sum(local_state(lr.run_dir, lr.steps) != "COMPLETED" for lr in lruns)
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = open(out_dir / ".sweep-local.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SweepError(f"another `m2po sweep --local` is running this sweep ({out_dir}); wait for it or "
                         f"stop it first") from None
    try:
        _write_manifest(sweep, sweep_path, out_dir, lruns, parallel)
        return _schedule(lruns, parallel, out, poll_s, report_every_s)
    finally:
        lock.close()


def _schedule(lruns: list[LocalRun], parallel: int, out, poll_s: float, report_every_s: float) -> int:
    total = len(lruns)
    todo: list[LocalRun] = []
    done = 0
    for lr in lruns:
        state = local_state(lr.run_dir, lr.steps)
        if state == "COMPLETED":
            done += 1
            print(f"[sweep] skip {lr.run.name}: finished ({lr.run_dir})", file=out, flush=True)
        elif state == "RUNNING":
            raise SweepError(f"run {lr.run.name} is running in another process ({lr.run_dir}/logs/job-state); "
                             f"stop it first")
        else:
            todo.append(lr)
    print(f"[sweep] {len(todo)} of {total} runs to do, {parallel} at a time", file=out, flush=True)
    running: list[LocalRun] = []
    failed: list[str] = []
    durations: list[float] = []
    t_start = last_report = time.monotonic()
    stopping = {"sig": None}

    def on_signal(signum, _frame):  # pass a stop on to the runs: each checkpoints and exits (resumable)
        stopping["sig"] = signum
        for lr in running:
            if lr.proc and lr.proc.poll() is None:
                lr.proc.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while todo or running:
            while todo and len(running) < parallel and stopping["sig"] is None:
                lr = todo.pop(0)
                _start(lr, out, parallel)
                running.append(lr)
            if not todo and not running:
                break
            time.sleep(poll_s)
            for lr in list(running):
                rc = lr.proc.poll()
                if rc is None:
                    continue
                running.remove(lr)
                lr.log.close()
                _record(lr.run_dir, f"EXIT job=local:{lr.proc.pid} {time.strftime('%Y-%m-%dT%H:%M:%S')} rc={rc}")
                state = local_state(lr.run_dir, lr.steps)
                took = time.monotonic() - lr.t0
                if state == "COMPLETED":
                    done += 1
                    durations.append(took)
                else:
                    failed.append(lr.run.name)
                print(f"[sweep] {lr.run.name}: {state} after {_hms(took)} (log {lr.run_dir}/logs/{LOCAL_LOG})",
                      file=out, flush=True)
            if stopping["sig"] is not None and not running:
                break
            if time.monotonic() - last_report >= report_every_s and running:
                last_report = time.monotonic()
                print(_progress_line(done, total, running, durations, t_start, len(todo), parallel),
                      file=out, flush=True)
    except BaseException:  # the runner itself failed: stop its runs too (they checkpoint; a restart resumes)
        on_signal(signal.SIGTERM, None)
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    left = total - done
    if stopping["sig"] is not None:
        print(f"[sweep] stopped by signal {stopping['sig']}: {done}/{total} finished; run the same command "
              f"again to continue", file=out, flush=True)
    else:
        print(f"[sweep] {done}/{total} finished in {_hms(time.monotonic() - t_start)}"
              + (f"; not finished: {', '.join(failed)}" if failed else ""), file=out, flush=True)
    return left


def _env(parallel: int) -> dict:
    """The runs share this machine's cores: a CPU rollout server gets its share of intra-op threads (2
    threads each for 2 runs on 2 cores made generation up to 6x slower here: the threads of one matmul wait
    for each other while another process holds the core)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("M2PO_CPU_SERVER_THREADS", str(max(1, (os.cpu_count() or 1) // parallel)))
    return env


def _start(lr: LocalRun, out, parallel: int) -> None:
    logs = lr.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    lr.log = open(logs / LOCAL_LOG, "a")
    resume = latest_checkpoint_step(lr.run_dir)
    lr.t0 = time.monotonic()
    lr.proc = subprocess.Popen(_command(lr.run), stdout=lr.log, stderr=subprocess.STDOUT, env=_env(parallel),
                               start_new_session=True)
    _record(lr.run_dir, f"START job=local:{lr.proc.pid} host={socket.gethostname()} "
                        f"{time.strftime('%Y-%m-%dT%H:%M:%S')}")
    print(f"[sweep] start {lr.run.name}" + (f" (resuming from step {resume})" if resume else "")
          + f": {lr.run_dir}", file=out, flush=True)
