"""What a sandboxed run may use (:class:`Limits`), what came of it (:class:`RunResult`, one ``reason`` from a
fixed set), and the trusted launcher that applies the limits inside the sandbox before the untrusted program
starts.

The launcher is a few lines of Python run as ``python -I -c LAUNCHER tag script [args]``. Its child sets the
rlimits, drops to an unprivileged uid when told to (as root, the sandbox starts as root of its own user
namespace), tells the parent through a status pipe that setup is done (so a broken sandbox is never mistaken
for a crashing program), closes every inherited descriptor, and only then runs ``script`` as ``__main__`` in
the same interpreter (one Python start per run, not two). Its parent waits and reports the child's CPU time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

# Why a run (or, in the code reward, a test case) ended. The first seven come from running; the code reward
# adds the verdicts.
OK, RUNTIME_ERROR, TIMEOUT, MEMORY, OUTPUT_LIMIT, KILLED, SANDBOX_ERROR = (
    "ok", "runtime_error", "timeout", "memory", "output_limit", "killed", "sandbox_error")
WRONG_ANSWER, NO_CODE = "wrong_answer", "no_code"
RUN_REASONS = (OK, RUNTIME_ERROR, TIMEOUT, MEMORY, OUTPUT_LIMIT, KILLED, SANDBOX_ERROR)
FAILURE_REASONS = (WRONG_ANSWER, RUNTIME_ERROR, TIMEOUT, MEMORY, OUTPUT_LIMIT, KILLED, SANDBOX_ERROR, NO_CODE)

NOBODY = 65534  # the uid/gid untrusted code runs as when we start as root (see bwrap.py for why it matters)
STDERR_TAIL_BYTES = 2048


@dataclass(frozen=True)
class Limits:
    """Per-run limits. ``timeout_s`` is wall clock, enforced from outside; the CPU-time rlimit is the same
    number rounded up (a busy loop dies of SIGXCPU even if the parent is slow to notice)."""
    timeout_s: float = 5.0
    memory_mb: int = 512  # RLIMIT_AS of the program (virtual memory: a Python start needs ~30 MB)
    max_processes: int = 16  # RLIMIT_NPROC inside the sandbox's own user namespace (the program included)
    max_output_bytes: int = 1 << 20  # stdout + stderr together; past it the run is killed: output_limit
    file_size_mb: int = 16  # RLIMIT_FSIZE: the largest file the program may write (in its private /tmp)
    tmpfs_mb: int = 64  # size of the private /tmp
    open_files: int = 256  # RLIMIT_NOFILE

    def check(self) -> list[str]:
        errors = []
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            errors.append(f"timeout_s = {self.timeout_s!r} must be a number of seconds > 0")
        for name, lo in (("memory_mb", 64), ("max_processes", 1), ("max_output_bytes", 1), ("file_size_mb", 1),
                         ("tmpfs_mb", 1), ("open_files", 16)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                errors.append(f"{name} = {v!r} must be an integer >= {lo}")
        return errors

    @property
    def cpu_s(self) -> int:
        return max(1, math.ceil(self.timeout_s))


@dataclass
class RunResult:
    reason: str  # one of RUN_REASONS
    exit_code: Optional[int]  # the program's exit status (None when it was killed by a signal)
    signal: Optional[int]  # the signal that ended it, if any
    stdout: bytes = b""  # at most Limits.max_output_bytes
    stderr_tail: str = ""  # the last STDERR_TAIL_BYTES of stderr, decoded
    wall_s: float = 0.0
    cpu_s: float = 0.0  # user + system time of everything the run started
    detail: str = ""  # why, for sandbox_error (never the program's output)
    extra: dict = field(default_factory=dict)


# Runs as `python -I -c LAUNCHER <tag> <script> [args...]` (sys.argv[0] is "-c"). It forks: the child sets the
# rlimits, drops its uid when told to, reports "1" on the status pipe, closes every inherited fd and runs the
# script; the parent only waits, then reports the child's CPU time ("cpu <seconds>") and exits with the
# child's status (128 + N for a signal N, as bwrap does), so the supervisor learns the CPU time of the whole
# program even where bwrap's reaper does not pass it on. {limits}, {drop}, {status_fd} come from launcher_source.
_LAUNCHER = """\
# m2po-sandbox launcher
import _signal, os, resource, sys  # _signal, not signal: that one imports enum (~6 ms per run)
pid = os.fork()
if pid:
    os.closerange(3, {status_fd})
    os.closerange({status_fd} + 1, 1 << 16)
    while True:
        try:
            _, st, ru = os.wait4(pid, 0)
            break
        except InterruptedError:
            continue
    os.write({status_fd}, b"cpu %.6f" % (ru.ru_utime + ru.ru_stime))
    os._exit(128 + os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st))
for s in (_signal.SIGTERM, _signal.SIGINT, _signal.SIGUSR1):
    _signal.signal(s, _signal.SIG_DFL)  # a reward worker ignores these; the program gets the defaults back
for r, v in {limits}:
    resource.setrlimit(r, v)
drop = {drop}
if drop is not None:
    os.setgroups([])
    os.setgid(drop)
    os.setuid(drop)  # from root: all capabilities are gone from here on
    if os.getuid() != drop or os.geteuid() != drop:
        os._exit(70)
os.write({status_fd}, b"1")
os.closerange(3, 1 << 16)  # the status pipe and whatever else was passed through (bwrap's fds)
script = sys.argv[2]
sys.argv = sys.argv[2:]
main = type(sys)("__main__")  # a fresh __main__ (runpy.run_path does the same, but importing it costs ~20 ms)
main.__file__ = script
main.__builtins__ = __builtins__
sys.modules["__main__"] = main
with open(script, "rb") as f:
    code = compile(f.read(), script, "exec")
exec(code, main.__dict__)
"""


def launcher_source(limits: Limits, drop_to: Optional[int], status_fd: int) -> str:
    mb = 1 << 20
    rl = [
        ("resource.RLIMIT_CPU", (limits.cpu_s, limits.cpu_s + 1)),  # soft: SIGXCPU, hard: SIGKILL a second later
        ("resource.RLIMIT_AS", (limits.memory_mb * mb,) * 2),
        ("resource.RLIMIT_NPROC", (limits.max_processes,) * 2),
        ("resource.RLIMIT_FSIZE", (limits.file_size_mb * mb,) * 2),
        ("resource.RLIMIT_NOFILE", (limits.open_files,) * 2),
        ("resource.RLIMIT_CORE", (0, 0)),
    ]
    lim = "(" + ", ".join(f"({name}, {v!r})" for name, v in rl) + ",)"
    return _LAUNCHER.format(limits=lim, drop=repr(drop_to), status_fd=int(status_fd))
