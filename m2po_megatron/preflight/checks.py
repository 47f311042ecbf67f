"""The check protocol: a Check names a module's `run(cfg, ctx)`, its time limit and whether it needs Ray; a
Result says ok, fail or skipped, with the measured numbers and, for a failure, the likely cause and the fix.

A check signals its outcome by returning a dict of numbers (ok) or raising CheckFailed / CheckSkipped. Each
runs in a fresh `python -m m2po_megatron.preflight.checks IN OUT` in its own session: past its limit the whole
process group (a server it started included) gets SIGTERM, then SIGKILL, so no check can hang the command."""
from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

STATUSES = ("ok", "fail", "skipped")
GRACE_S = 5.0


class CheckFailed(Exception):
    """A check's failure: what went wrong (`cause`), what to do about it (`fix`), and what was measured."""

    def __init__(self, cause: str, fix: str, numbers: Optional[dict] = None):
        super().__init__(cause)
        self.cause, self.fix, self.numbers = cause, fix, dict(numbers or {})


class CheckSkipped(Exception):
    """The check cannot run here (no GPU, a package only the GPU image has); the reason says why."""

    def __init__(self, reason: str, numbers: Optional[dict] = None):
        super().__init__(reason)
        self.reason, self.numbers = reason, dict(numbers or {})


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    module: str        # m2po_megatron.preflight.<module>, whose run(cfg, ctx) -> dict is the check
    limit_s: float     # before --timeout-scale
    needs_ray: bool
    what: str          # one line for the table's legend and docs/preflight.md


# In the order they run: the cheap, fundamental ones first.
CHECKS = {c.name: c for c in (
    Check("ray", "ray_check", 120, True, "Ray across the nodes, trainer ranks and servers placed as the recipe asks"),
    Check("comm", "comm", 120, True, "all-reduce and broadcast bandwidth over the default backend, vs the planner"),
    Check("te", "te", 180, False, "Transformer Engine layers and one FP8 step against bf16 on a tiny model"),
    Check("engine", "engine", 420, True, "a tiny rollout server as the recipes launch it, a weight update, a "
                                         "generation that shows it"),
    Check("memory", "memory", 300, False, "the memory estimate against one real step of the first micro-batch"),
)}


@dataclasses.dataclass
class Result:
    name: str
    status: str                      # ok | fail | skipped
    seconds: float
    limit_s: float
    numbers: dict = dataclasses.field(default_factory=dict)
    cause: Optional[str] = None      # fail: the likely cause; skipped: the reason
    fix: Optional[str] = None        # fail: what to do
    detail: Optional[str] = None     # fail: the tail of the check's output or traceback

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} must be one of {STATUSES}")
        if self.status == "fail" and not (self.cause and self.fix):
            raise ValueError(f"check {self.name}: a failure must name its cause and its fix")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def outcome(name: str, fn, cfg, ctx: dict, limit_s: float) -> Result:
    """Run fn(cfg, ctx) here and turn what it returned or raised into a Result."""
    t0 = time.perf_counter()
    secs = lambda: round(time.perf_counter() - t0, 2)  # noqa: E731
    try:
        numbers = fn(cfg, ctx) or {}
        return Result(name, "ok", secs(), limit_s, numbers)
    except CheckSkipped as e:
        return Result(name, "skipped", secs(), limit_s, e.numbers, cause=e.reason)
    except CheckFailed as e:
        return Result(name, "fail", secs(), limit_s, e.numbers, cause=e.cause, fix=e.fix)
    except Exception as e:  # noqa: BLE001 - an unexpected error is a failure with its traceback
        return Result(name, "fail", secs(), limit_s, cause=f"{type(e).__name__}: {str(e)[:500]}",
                      fix="an error the check does not recognise; the traceback is in `detail` of the JSON summary",
                      detail=traceback.format_exc()[-3000:])


def _kill_group(pgid: int) -> None:
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 0.0)):
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


def run_check(check: Check, recipe: Optional[str], overrides: list[str], ctx: dict, scale: float = 1.0) -> Result:
    """`check` in its own process group within check.limit_s x scale seconds; a check that passes its limit is
    killed (with whatever it started) and reported as failed, naming the limit."""
    limit = check.limit_s * scale
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"m2po-preflight-{check.name}-") as tmp:
        inp, outp, logp = Path(tmp) / "in.pkl", Path(tmp) / "out.pkl", Path(tmp) / "log.txt"
        inp.write_bytes(pickle.dumps((check, recipe, overrides, {**ctx, "limit_s": limit})))
        os.chmod(inp, 0o600)  # it may carry the servers' API key
        with open(logp, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", __name__, str(inp), str(outp)], stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                proc.wait(timeout=limit)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc.pid)  # stragglers too: a server the check started must not outlive it
                proc.wait()
        tail = "\n".join(logp.read_text(errors="replace").splitlines()[-30:])[-3000:]
        secs = round(time.perf_counter() - t0, 2)
        if timed_out:
            return Result(check.name, "fail", secs, limit, cause=f"no result within its time limit of {limit:.0f} s "
                                                                 "(the check and what it started were killed)",
                          fix="something it waits on hangs (a node, a collective, a server start): see `detail`; on a "
                              "slow or first start, --timeout-scale 2 gives every check twice the time", detail=tail)
        if not outp.exists():
            return Result(check.name, "fail", secs, limit, cause=f"the check's process exited with code "
                                                                 f"{proc.returncode} without a result",
                          fix="a crash below Python (a driver, a library); see `detail`", detail=tail)
        res = Result(**pickle.loads(outp.read_bytes()))
        res.seconds = secs
        if res.status == "fail" and not res.detail:
            res.detail = tail or None
        return res


def _child(inp: str, outp: str) -> None:
    check, recipe, overrides, ctx = pickle.loads(Path(inp).read_bytes())
    import importlib

    from m2po_megatron.config import load_config
    # this file runs as __main__ here: the checks raise the importable module's CheckFailed / CheckSkipped
    from m2po_megatron.preflight.checks import outcome

    cfg = load_config(recipe, overrides, check_files=False)
    fn = importlib.import_module(f"m2po_megatron.preflight.{check.module}").run
    res = outcome(check.name, fn, cfg, ctx, ctx["limit_s"])
    Path(outp).write_bytes(pickle.dumps(res.to_dict()))  # a dict: this module runs as __main__ here
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no waiting on threads a library left behind: the parent ends the group


def connect_ray(ctx: dict) -> Any:
    """Join the command's Ray cluster (the private one it started, or the recipe's cluster.ray_address)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        ray.init(address=ctx["ray_address"], logging_level="ERROR", log_to_driver=False)
    return ray


def cluster_has_gpus(ray) -> bool:
    """Whether the Ray cluster's nodes offer GPUs: the driver's own step may see none where its nodes' Ray workers
    do (an srun step without --gpus), and the Ray checks run on those workers."""
    return any(n["Resources"].get("GPU", 0) > 0 for n in ray.nodes() if n.get("Alive"))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
