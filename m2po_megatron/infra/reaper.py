"""Reclaim a run's processes and its private Ray temp dir when the driver ends, however it ends.

Every process of a run carries `M2PO_RUN_TOKEN` in its environment: the driver sets it before Ray starts,
and Ray's node processes and agents, the trainer and server actors, the rollout servers and the reward
workers inherit it. `start` launches a small guardian (`python -m m2po_megatron.infra.reaper`) in its own session
that blocks on a pipe only the driver holds: when the driver exits (normally, by an exception, by SIGKILL)
the read returns EOF, and the guardian SIGKILLs every process of this user that still carries the token,
then removes the private Ray temp dir. Without it, Ray's dashboard and runtime-env agents outlive a killed
driver for minutes (they try to report the raylet's death to a GCS that is already gone), listening on
0.0.0.0. As a second line, `clean_stale` (called at the next start) does the same for private temp dirs
whose owner is dead, in case the guardian was killed too.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

TOKEN_ENV = "M2PO_RUN_TOKEN"
OWNER_FILE = "m2po-owner.json"
PREFIX = "m2po-ray-"


def new_token() -> str:
    """A fresh token for this driver, in os.environ so that every process started from now on inherits it."""
    token = uuid.uuid4().hex
    os.environ[TOKEN_ENV] = token
    return token


def _start_time(pid: int) -> Optional[int]:
    """The kernel's start time of `pid` (clock ticks since boot), or None when it is gone: with the pid it
    names one process even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _uses_session(pid: str, tmpdir: str, driver_pid: int) -> bool:
    """Whether a process has a file open in the Ray session that `driver_pid` started under `tmpdir`
    (tmpdir/session_<date>_<time>_<driver pid>/: Ray's processes keep their logs there)."""
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(tmpdir + "session_"):
                session = target[len(tmpdir):].split(os.sep, 1)[0]
                if session.endswith(f"_{driver_pid}"):
                    return True
    except OSError:
        pass
    return False


def processes_with(token: str, tmpdir: Optional[str] = None, driver_pid: Optional[int] = None) -> list[int]:
    """This user's processes (not this one) whose environment carries the token, or, given the Ray temp
    dir and the driver's pid, that have a file open in the driver's Ray session: Ray's agents rename
    themselves with setproctitle, which can overwrite the environment that /proc shows."""
    needle = f"{TOKEN_ENV}={token}\0".encode()
    tmpdir = os.path.realpath(tmpdir) + os.sep if tmpdir else None
    uid, out = os.getuid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (os.getpid(), driver_pid):  # the driver ends on its own
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            env = Path(f"/proc/{name}/environ").read_bytes()
        except OSError:
            continue
        if needle in env or (tmpdir and driver_pid and _uses_session(name, tmpdir, driver_pid)):
            out.append(int(name))
    return out


def sweep(token: str, tmpdir: Optional[str] = None, driver_pid: Optional[int] = None, timeout_s: float = 30.0) -> int:
    """SIGKILL every process of the run (see processes_with) until none is left (or timeout_s). Returns
    how many were killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = processes_with(token, tmpdir, driver_pid)
        live = [p for p in pids if Path(f"/proc/{p}/stat").exists() and "Z" != _state(p)]
        if not live:
            break
        for pid in live:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except OSError:
                pass
        time.sleep(0.2)  # let the kernel reap them before looking again
    return len(killed)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def write_owner(tmpdir: str, token: str, owned: bool) -> None:
    """Record who uses a private Ray temp dir, so that a later start can tell a dead owner's dir."""
    info = {"pid": os.getpid(), "start": _start_time(os.getpid()), "token": token, "delete": owned}
    Path(tmpdir, OWNER_FILE).write_text(json.dumps(info))


def clean_stale(root: Optional[str] = None) -> list[str]:
    """Private Ray temp dirs (PREFIX*) under `root` (default: the system temp dir) whose owner process is
    gone: kill what still carries their token and remove them. Returns the dirs removed."""
    import tempfile

    base = Path(root or tempfile.gettempdir())
    removed = []
    for d in base.glob(f"{PREFIX}*"):
        try:
            if d.stat().st_uid != os.getuid():
                continue
            info = json.loads((d / OWNER_FILE).read_text())
            pid, start, token = int(info["pid"]), info.get("start"), str(info["token"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours, or being created right now
        if _start_time(pid) is not None and _start_time(pid) == start:
            continue  # its driver is alive
        sweep(token, str(d), pid)
        shutil.rmtree(d, ignore_errors=True)
        removed.append(str(d))
    return removed


class Reaper:
    """The driver's handle on its guardian: `close()` (normal end) lets it sweep now and waits for it."""

    def __init__(self, token: str, tmpdir: Optional[str], delete_tmpdir: bool):
        r, self._w = os.pipe()  # both ends non-inheritable: only the guardian gets the read end
        cmd = [sys.executable, "-m", "m2po_megatron.infra.reaper", "--token", token, "--fd", str(r),
               "--driver-pid", str(os.getpid())]
        if tmpdir:
            cmd += ["--tmpdir", tmpdir] + (["--delete"] if delete_tmpdir else [])
        self.proc = subprocess.Popen(cmd, pass_fds=(r,), start_new_session=True, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(r)

    def close(self, timeout_s: float = 60.0) -> None:
        if self._w is not None:
            os.close(self._w)
            self._w = None
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m m2po_megatron.infra.reaper")
    p.add_argument("--token", required=True)
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--driver-pid", type=int, required=True)
    p.add_argument("--tmpdir", help="the Ray temp dir the driver started its session in")
    p.add_argument("--delete", action="store_true", help="remove --tmpdir after the sweep")
    args = p.parse_args(argv)
    # Ctrl-C, a closed terminal, or a stop signal sent to every process of a Slurm step must not stop the
    # cleanup; the guardian ends by itself once the driver has gone
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    while True:  # EOF: the driver closed the pipe or died
        try:
            if not os.read(args.fd, 4096):
                break
        except InterruptedError:
            continue
    sweep(args.token, args.tmpdir, args.driver_pid)
    if args.tmpdir and args.delete:
        shutil.rmtree(args.tmpdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
