"""Start a (sandboxed or plain) program run, feed its stdin, read its output under a byte cap, enforce the
wall-clock limit from outside, and say how it ended (a :class:`RunResult` with one reason).

Shared by the bubblewrap sandbox (bwrap.py) and the explicitly unsafe unsandboxed mode, so both are limited,
killed and classified the same way.
"""
from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

from .limits import (KILLED, MEMORY, NOBODY, OK, OUTPUT_LIMIT, RUNTIME_ERROR, SANDBOX_ERROR, STDERR_TAIL_BYTES,
                     TIMEOUT, Limits, RunResult, launcher_source)

# What the program's environment holds: nothing of the run's own (API keys, tokens, paths).
PROGRAM_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
_MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory")


def interpreter() -> str:
    """The Python that runs untrusted programs: the real binary behind this process's interpreter (a venv's
    python is a symlink to it), whose own standard library is what the program gets."""
    return os.path.realpath(sys.executable)


def supervise(argv: list[str], stdin: bytes, limits: Limits, *, pass_fds: tuple[int, ...], status_fd: int,
              env: dict[str, str], cwd: Optional[str] = None, close_after_start: tuple[int, ...] = ()) -> RunResult:
    """Run ``argv`` (which runs the launcher) to completion or to a limit. ``status_fd`` is the read end of the
    launcher's status pipe; its write end is among ``close_after_start`` (closed here once the child holds it,
    or the pipe would never report EOF). The launcher (and bwrap) report a program killed by signal N as exit
    status 128 + N."""
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=pass_fds, env=env, cwd=cwd, start_new_session=True, umask=0o022)
    except OSError as exc:
        os.close(status_fd)
        return RunResult(SANDBOX_ERROR, None, None, detail=f"cannot start {argv[0]}: {exc.strerror or exc}")
    finally:
        for fd in close_after_start:
            os.close(fd)
    out, err_tail, err_total, report, killed_for = _pump(proc, stdin, limits, status_fd, t0 + limits.timeout_s)
    _, status, usage = os.wait4(proc.pid, 0)  # reaped here (not by Popen) for the rusage
    proc.returncode = os.waitstatus_to_exitcode(status)
    launched = report.startswith(b"1")  # the launcher's child got as far as starting the program
    for f in (proc.stdin, proc.stdout, proc.stderr):
        try:
            f.close()
        except OSError:  # the stdin pipe may be broken
            pass
    wall = time.monotonic() - t0
    # the launcher's report when it outlived the program; else (killed from outside) what the kernel handed us,
    # a lower bound
    cpu_at = report.find(b"cpu ")
    cpu = float(report[cpu_at + 4:]) if cpu_at >= 0 else usage.ru_utime + usage.ru_stime
    code: Optional[int] = None
    sig: Optional[int] = None
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
    else:
        code = os.WEXITSTATUS(status)
        if launched and code > 128 and code - 128 in signal.valid_signals():
            code, sig = None, code - 128
    stderr = err_tail.decode("utf-8", "replace")
    res = RunResult(OK, code, sig, bytes(out), stderr, wall, cpu)
    if killed_for:
        res.reason = killed_for
    elif not launched:  # the launcher never reported: the sandbox itself failed (its message is on stderr)
        res.reason = SANDBOX_ERROR
        res.detail = stderr.strip()[-500:] or f"exit status {code if sig is None else -sig}, no message"
    elif sig is not None:
        cpu_out = sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= limits.cpu_s)
        res.reason = TIMEOUT if cpu_out else KILLED
    elif code != 0:
        res.reason = MEMORY if any(m in stderr for m in _MEMORY_MARKERS) else RUNTIME_ERROR
    res.extra["stderr_bytes"] = err_total
    return res


def _pump(proc: subprocess.Popen, stdin: bytes, limits: Limits, status_fd: int, deadline: float):
    """Feed stdin and drain stdout/stderr/status until the program has exited and closed its output, or a
    limit is hit. The process is watched through a pidfd, which does not reap it (supervise does)."""
    sel = selectors.DefaultSelector()
    out, err = bytearray(), bytearray()
    err_total, killed_for, exited = 0, "", False
    report = bytearray()  # what the launcher wrote on the status pipe
    pending = memoryview(stdin)
    pidfd = os.pidfd_open(proc.pid)
    os.set_blocking(status_fd, False)
    for f, what in ((proc.stdout, "out"), (proc.stderr, "err")):
        os.set_blocking(f.fileno(), False)
        sel.register(f.fileno(), selectors.EVENT_READ, what)
    sel.register(status_fd, selectors.EVENT_READ, "status")
    sel.register(pidfd, selectors.EVENT_READ, "exit")
    if pending:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE, "in")
    else:
        proc.stdin.close()
    open_streams = 2
    try:
        while (open_streams or not exited) and not killed_for:
            left = deadline - time.monotonic()
            if left <= 0:
                killed_for = TIMEOUT
                break
            for key, _ in sel.select(left):
                what = key.data
                if what == "exit":
                    exited = True
                    sel.unregister(key.fd)
                elif what == "in":
                    try:
                        pending = pending[os.write(key.fd, pending[:1 << 16]):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # it stopped reading: the rest of its input is not wanted
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(key.fd)
                        proc.stdin.close()
                else:
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        sel.unregister(key.fd)
                        open_streams -= what != "status"
                    elif what == "status":
                        report += chunk
                    elif what == "out":
                        out += chunk
                    else:
                        err_total += len(chunk)
                        err = (err + chunk)[-STDERR_TAIL_BYTES:]
                    if len(out) + err_total > limits.max_output_bytes:
                        del out[limits.max_output_bytes:]
                        killed_for = OUTPUT_LIMIT
                        break
    finally:
        if not exited:
            _kill(proc)
        while True:  # what the launcher wrote just before it exited
            try:
                chunk = os.read(status_fd, 256)
            except OSError:
                break
            if not chunk:
                break
            report += chunk
        sel.close()
        os.close(status_fd)
        os.close(pidfd)
    return out, err, err_total, bytes(report), killed_for


def _kill(proc: subprocess.Popen) -> None:
    # The process group holds bwrap (whose --die-with-parent takes the sandbox's whole pid namespace with it)
    # or, unsandboxed, the program and the children it did not move to a new session.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reachable_by_others(path: str) -> bool:
    """Whether an unprivileged user could run the interpreter at `path` (every directory above it searchable)."""
    p = os.path.realpath(path)
    while p != "/":
        p = os.path.dirname(p)
        if not os.stat(p).st_mode & 0o001:
            return False
    return (os.stat(path).st_mode & 0o005) == 0o005


def run_unsandboxed(files: dict[str, bytes], main: str, stdin: bytes, limits: Limits, args: tuple[str, ...] = (),
                    tag: str = "m2po-sandbox") -> RunResult:
    """Run the program as a plain subprocess with the same rlimits, a minimal environment and a private
    temporary directory (deleted afterwards). It sees the whole host file system and network: for development
    on a machine without a working sandbox only (the code reward's allow_unsandboxed)."""
    exe = interpreter()
    # As root, RLIMIT_NPROC binds nothing; drop to nobody when that user can run the interpreter at all.
    drop = NOBODY if os.geteuid() == 0 and _reachable_by_others(exe) else None
    work = tempfile.mkdtemp(prefix="m2po-unsandboxed-")
    try:
        for name, data in files.items():
            with open(os.path.join(work, name), "wb") as f:
                f.write(data)
            os.chmod(os.path.join(work, name), 0o444)
        if drop is not None:
            os.chown(work, drop, drop)
        os.chmod(work, 0o700)
        r, w = os.pipe()
        argv = [exe, "-I", "-c", launcher_source(limits, drop, w), tag, os.path.join(work, main), *args]
        return supervise(argv, stdin, limits, pass_fds=(w,), status_fd=r, env=dict(PROGRAM_ENV, HOME=work),
                         cwd=work, close_after_start=(w,))
    finally:
        shutil.rmtree(work, ignore_errors=True)
