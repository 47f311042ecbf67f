"""One gpu_check part in its own process group, with a time limit that kills the whole group.

The part runs in a fresh `python runner.py IN OUT` started with start_new_session=True (its own session and
process group), as rank 0 of a one-process torch.distributed group (torchrun-style env, a rendezvous store
served in the same process). When its budget passes, the group gets SIGTERM, then SIGKILL 5 s later; after a
normal end the group gets SIGKILL too, so nothing the part spawned (pytest's ranks, a compile worker, a
child that ignores SIGTERM) keeps the GPU busy. The function and its arguments travel pickled (by reference:
the child gets the parent's sys.path); so does the result.
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

GRACE_S = 5.0
ACTIVE: set[int] = set()  # process groups of the parts running now (killed if this process is stopped)


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def kill_group(pgid: int, grace_s: float = GRACE_S) -> None:
    """SIGTERM to the process group, then SIGKILL to whatever is left of it after grace_s."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        end = time.monotonic() + wait
        while time.monotonic() < end:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.1)


def stop_parts_on_signals() -> None:
    """On SIGTERM / SIGINT / SIGHUP (tools/gpu_check.sh's hard stop, a device command's end), kill the running
    parts' groups, then exit: each part has its own session, so no signal to this process reaches it, and a
    machine keeps processes of another session running after the command that started them."""
    def handler(signum, frame):
        for pgid in list(ACTIVE):
            kill_group(pgid, 0.0)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, handler)


def start_group(cmd: list, **kw) -> subprocess.Popen:
    """cmd in a new session (its own process group), registered in ACTIVE until end_group."""
    proc = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL, **kw)
    ACTIVE.add(proc.pid)
    return proc


def wait_group(proc: subprocess.Popen, budget_s: float) -> bool:
    """Wait up to budget_s; then kill the whole group either way (stragglers too). True when it timed out."""
    timed_out = False
    try:
        proc.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        kill_group(proc.pid, GRACE_S if timed_out else 0.0)
        proc.wait()
        ACTIVE.discard(proc.pid)
    return timed_out


def run_part(name: str, fn, args: tuple, budget_s: float, tail_lines: int = 40) -> dict:
    """fn(*args) (returning a dict) in its own process group within budget_s seconds. Returns its dict, or
    {"error": ...} when it raised, died or ran past the budget; "wall_s" added either way."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"gpu_check-{name}-") as tmp:
        inp, outp, logp = Path(tmp) / "in.pkl", Path(tmp) / "out.pkl", Path(tmp) / "log.txt"
        inp.write_bytes(pickle.dumps((fn, args)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)))
        env.setdefault("OMP_NUM_THREADS", "1")  # as launch.run_multiprocess: the GPU computes; no oversubscription
        env.setdefault("MKL_NUM_THREADS", "1")
        with open(logp, "wb") as logf:
            proc = start_group([sys.executable, __file__, str(inp), str(outp)], stdout=logf,
                               stderr=subprocess.STDOUT, env=env)
            timed_out = wait_group(proc, budget_s)
        tail = "\n".join(logp.read_text(errors="replace").splitlines()[-tail_lines:])
        if timed_out:
            out = {"error": f"part {name!r} ran past its budget of {budget_s:.0f} s; its process group was "
                            f"killed", "log_tail": tail[-3000:]}
        elif not outp.exists():
            out = {"error": f"part {name!r} exited with code {proc.returncode} without a result",
                   "log_tail": tail[-3000:]}
        else:
            ok, payload = pickle.loads(outp.read_bytes())
            out = payload if ok else {"error": payload[-4000:], "log_tail": tail[-2000:]}
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    log(f"{name}: {'ERROR ' + out['error'][-300:] if 'error' in out else 'ok'} ({out['wall_s']} s)")
    return out


def _child(inp: str, outp: str) -> None:
    """Rank 0 of a one-process group: the torchrun variables the actor reads, a store served here."""
    ok, payload = False, ""
    try:
        from m2po_megatron.infra.net import rendezvous_env, serve_rendezvous

        store = serve_rendezvous("127.0.0.1")  # noqa: F841 - kept alive for the group's lifetime
        os.environ.update(rendezvous_env("127.0.0.1", store), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                          LOCAL_WORLD_SIZE="1")
        import torch

        torch.set_num_threads(int(os.environ.get("M2PO_THREADS_PER_RANK", "1")))
        fn, args = pickle.loads(Path(inp).read_bytes())
        payload, ok = fn(*args), True
    except BaseException:  # noqa: BLE001 - the parent reports it
        payload = traceback.format_exc()
    Path(outp).write_bytes(pickle.dumps((ok, payload)))
    sys.stdout.flush()
    os._exit(0)  # no atexit / thread joins: the parent reads the result and ends the group


if __name__ == "__main__":
    for p in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if p and p not in sys.path:
            sys.path.append(p)
    _child(sys.argv[1], sys.argv[2])
