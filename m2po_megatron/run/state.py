"""Checkpoint directories that are either complete or ignored, the run-state file, RNG capture, and a
SIGTERM/SIGUSR1 flag for clean stops before a Slurm time limit.

Layout under `root_dir`:
    step_0000100/          a complete checkpoint (contains the marker file COMPLETE, written last)
    .tmp.step_0000150/     being written (or left by a crash): never returned by latest()
    .trash.step_0000050.*  being deleted (renamed first, so a half-deleted dir never looks complete)

Multi-rank use: every rank calls `tmp_dir(step)` (pure) to get the same path; rank 0 calls `begin(step)`
before a barrier, all ranks write (Megatron's distributed checkpoint, the run state), barrier, then
rank 0 calls `commit(step)`.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterable, Optional, Union

__all__ = [
    "MARKER",
    "RUN_STATE_SCHEMA_VERSION",
    "CheckpointManager",
    "RunStateError",
    "StopFlag",
    "StopNow",
    "capture_rng_state",
    "install_sigterm_flag",
    "load_run_state",
    "restore_rng_state",
    "save_run_state",
]

MARKER = "COMPLETE"
RUN_STATE_SCHEMA_VERSION = 1
_FORMAT = "m2po-run-state"
_STEP_RE = re.compile(r"^step_(\d{7,})$")
PathLike = Union[str, os.PathLike]


class RunStateError(RuntimeError):
    """A run-state file or checkpoint is missing, corrupt, partially written or of another schema."""


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    # Files first, then their directories, so that the rename publishes data that is on disk.
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            if not p.is_symlink():
                _fsync_path(p)
        _fsync_path(Path(dirpath))


def _remove_dir(path: Path) -> None:
    """Rename aside first (atomic), then delete: a crash mid-delete leaves only an ignored .trash dir."""
    trash = path.with_name(f".trash.{path.name}.{os.getpid()}.{time.monotonic_ns()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


class CheckpointManager:
    """Atomic, numbered checkpoint directories with keep-last pruning and resume resolution."""

    def __init__(self, root_dir: PathLike, keep_last: int = 2, fsync: bool = True):
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 0:
            raise ValueError(f"keep_last = {keep_last!r}: must be an integer >= 0 (0 keeps every checkpoint)")
        self.root = Path(root_dir)
        self.keep_last = keep_last
        self.fsync = fsync

    def step_dir(self, step: int) -> Path:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step = {step!r}: must be an integer >= 0")
        return self.root / f"step_{step:07d}"

    def tmp_dir(self, step: int) -> Path:
        """Where the checkpoint of `step` is written before commit (the same path on every rank)."""
        return self.root / f".tmp.{self.step_dir(step).name}"

    def begin(self, step: int) -> Path:
        """Create an empty temporary directory for `step` (removing a leftover from a crash) and return it."""
        tmp = self.tmp_dir(step)
        self.root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            _remove_dir(tmp)
        tmp.mkdir()
        return tmp

    def commit(self, step: int) -> Path:
        """Publish the temporary directory of `step` as step_XXXXXXX: fsync its files, write the marker
        last, rename atomically, then prune to keep_last. Re-committing a step replaces the old copy."""
        tmp, final = self.tmp_dir(step), self.step_dir(step)
        if not tmp.is_dir():
            raise RunStateError(f"commit({step}): {tmp} does not exist; call begin({step}) and write into it first")
        if self.fsync:
            _fsync_tree(tmp)
        marker = tmp / MARKER
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        with open(marker, "w") as f:  # the manifest lets a resume find a truncated or missing file before loading
            json.dump({"step": step, "time": time.time(), "files": files}, f)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        if self.fsync:
            _fsync_path(tmp)
        if final.exists():
            _remove_dir(final)
        os.rename(tmp, final)
        if self.fsync:
            _fsync_path(self.root)
        self._prune(step)
        return final

    def _prune(self, committed: int) -> None:
        for p in self.root.iterdir():
            if p.name.startswith(".trash."):
                shutil.rmtree(p, ignore_errors=True)  # left by a crash mid-delete
            elif p.name.startswith(".tmp.step_"):
                m = _STEP_RE.match(p.name[len(".tmp."):])
                if m and int(m.group(1)) < committed:
                    _remove_dir(p)  # an older attempt that never committed
        if self.keep_last:  # never in favour of an older one: only steps up to the one just committed count
            for s in [s for s in self.complete_steps() if s <= committed][:-self.keep_last]:
                _remove_dir(self.step_dir(s))

    def retire_newer(self, step: int) -> list[Path]:
        """Move complete checkpoints newer than `step` aside (`step_X.superseded-TIME`, ignored by latest()):
        a run resumed from `step` continues from there, so a later `--resume auto` must not pick them."""
        moved = []
        for s in self.complete_steps():
            if s > step:
                src = self.step_dir(s)
                dst = src.with_name(f"{src.name}.superseded-{time.strftime('%Y%m%d-%H%M%S')}")
                os.rename(src, dst)
                moved.append(dst)
        return moved

    def verify(self, path: PathLike) -> list[str]:
        """What is wrong with a complete checkpoint: files of its manifest that are missing or whose size
        changed (a truncated copy, a full disk). [] when intact (or written before manifests existed)."""
        path = Path(path)
        try:
            doc = json.loads((path / MARKER).read_text())
        except (OSError, ValueError) as e:
            return [f"{path / MARKER} is unreadable ({e})"]
        problems = []
        for rel, size in (doc.get("files") or {}).items() if isinstance(doc, dict) else []:
            f = path / rel
            if not f.is_file():
                problems.append(f"{f} is missing")
            elif f.stat().st_size != size:
                problems.append(f"{f} has {f.stat().st_size} bytes, {size} were written")
        return problems

    @staticmethod
    def is_complete(path: PathLike) -> bool:
        return (Path(path) / MARKER).is_file()

    @staticmethod
    def step_of(path: PathLike) -> int:
        """The step a checkpoint directory (step_XXXXXXX) holds."""
        m = _STEP_RE.match(Path(path).name)
        if m is None:
            raise ValueError(f"{path}: not a checkpoint directory (step_XXXXXXX)")
        return int(m.group(1))

    def complete_steps(self) -> list[int]:
        """Steps of complete checkpoints, ascending; dirs without the marker are ignored."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            m = _STEP_RE.match(p.name)
            if m and p.is_dir():
                if self.is_complete(p):
                    out.append(int(m.group(1)))
                else:
                    warnings.warn(f"ignoring {p}: no {MARKER} marker (partially written)", stacklevel=3)
        return sorted(out)

    def latest(self) -> Optional[Path]:
        steps = self.complete_steps()
        return self.step_dir(steps[-1]) if steps else None

    def _latest_intact(self) -> Optional[Path]:
        """The newest complete checkpoint whose files match its manifest; damaged newer ones are reported
        (stderr) and skipped. All damaged: RunStateError naming the first bad file."""
        damaged = []
        for s in reversed(self.complete_steps()):
            problems = self.verify(self.step_dir(s))
            if not problems:
                for d, why in damaged:
                    print(f"m2po: checkpoint {d} is damaged ({why}); resuming from {self.step_dir(s)} instead",
                          file=sys.stderr, flush=True)
                return self.step_dir(s)
            damaged.append((self.step_dir(s), problems[0]))
        if damaged:
            raise RunStateError(f"every checkpoint under {self.root} is damaged (newest: {damaged[0][0]}: "
                                f"{damaged[0][1]}); restore the file, or start over with --overwrite")
        return None

    def resolve_resume(self, spec: Optional[PathLike]) -> Optional[Path]:
        """'none' (or None/''): start fresh. 'auto': the latest complete checkpoint here, or None.
        A path: a complete checkpoint dir, or a checkpoint root whose latest complete one is taken."""
        if spec is None or str(spec) in ("", "none"):
            return None
        if str(spec) == "auto":
            return self._latest_intact()
        path = Path(spec)
        if not path.exists():
            raise RunStateError(f"resume = {str(spec)!r}: no such checkpoint; use 'auto', 'none' or a path")
        if self.is_complete(path):
            if problems := self.verify(path):
                raise RunStateError(f"checkpoint {path} is damaged: {'; '.join(problems[:3])}; resume from another "
                                    f"one (--resume PATH) or take the latest intact one with --resume auto")
            return path
        if path.is_dir() and (found := CheckpointManager(path, keep_last=0)._latest_intact()) is not None:
            return found
        raise RunStateError(f"resume = {str(spec)!r}: not a complete checkpoint (no {MARKER} marker, so it "
                            f"may be partially written) and holds no step_XXXXXXX checkpoint; use 'auto' "
                            f"to take the latest complete one")


# ----------------------------------------------------------------------------------------------------
# Run state: one JSON file with a schema version and a checksum
# ----------------------------------------------------------------------------------------------------
def _check_json(x: Any, where: str) -> None:
    if x is None or isinstance(x, (bool, int, float, str)):
        return
    if isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _check_json(v, f"{where}[{i}]")
        return
    if isinstance(x, dict):
        for k, v in x.items():
            if not isinstance(k, str):
                raise TypeError(f"run state {where}: key {k!r} is {type(k).__name__}; JSON keys must be str")
            _check_json(v, f"{where}.{k}")
        return
    raise TypeError(f"run state {where}: {type(x).__name__} is not JSON-serialisable; store tensors and "
                    f"batches in files and put their paths here (RNG states: use capture_rng_state)")


def _digest(state: dict) -> str:
    return hashlib.sha256(json.dumps(state, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def save_run_state(path: PathLike, state: dict[str, Any]) -> Path:
    """Write `state` (JSON types only; tuples come back as lists) atomically to `path`."""
    if not isinstance(state, dict):
        raise TypeError(f"run state must be a dict, got {type(state).__name__}")
    _check_json(state, "state")
    path = Path(path)
    doc = {"format": _FORMAT, "schema_version": RUN_STATE_SCHEMA_VERSION, "sha256": _digest(state),
           "state": state}
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load_run_state(path: PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise RunStateError(f"run state {path} does not exist; the checkpoint is incomplete")
    hint = "resume from an earlier checkpoint (resume=PATH) or start fresh (resume=none)"
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunStateError(f"run state {path} is corrupt or partially written ({e}); {hint}") from None
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or "state" not in doc:
        raise RunStateError(f"{path} is not an m2po run-state file; {hint}")
    if doc.get("schema_version") != RUN_STATE_SCHEMA_VERSION:
        raise RunStateError(f"run state {path} has schema version {doc.get('schema_version')}, this code "
                            f"reads {RUN_STATE_SCHEMA_VERSION}; use the matching m2po-megatron version")
    if _digest(doc["state"]) != doc.get("sha256"):
        raise RunStateError(f"run state {path} is corrupt (checksum mismatch); {hint}")
    return doc["state"]


# ----------------------------------------------------------------------------------------------------
# RNG states of this process, as JSON
# ----------------------------------------------------------------------------------------------------
def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU, and CUDA if initialised) RNG states of this process, JSON-safe.
    Each rank has its own; Megatron saves the ranks' RNG states in its own checkpoint."""
    import random

    import numpy as np
    import torch

    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out = {
        "python": [version, list(internal), gauss],
        "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))

    def tensor(b64: str) -> "torch.Tensor":
        return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["torch"]))
    if "cuda" in state:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all([tensor(s) for s in state["cuda"]])
        else:
            warnings.warn("run state holds CUDA RNG states but CUDA is unavailable; not restored", stacklevel=2)


# ----------------------------------------------------------------------------------------------------
# Clean stop on SIGTERM / SIGUSR1
# ----------------------------------------------------------------------------------------------------
class StopNow(BaseException):
    """A second stop signal, or the stop timeout: leave at once without a new checkpoint. A BaseException
    so that no `except Exception` on the way swallows it; cleanup in `finally` blocks still runs.
    Checkpoints stay consistent: one being written is an ignored .tmp directory."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class StopFlag:
    """`.requested` turns True when one of the signals arrives; the loop checks it between steps,
    checkpoints and exits. A second signal, or `timeout_s` passing after the first (0: no limit), raises
    StopNow in the main thread: leave now, keeping the latest complete checkpoint. Slurm may send USR1
    then TERM; the second only hurries the stop, it never interrupts the write of a checkpoint into a
    state that a resume would read."""

    HARD_EXIT_GRACE_S = 60.0  # after StopNow was raised, if the main thread is stuck in C code

    def __init__(self, timeout_s: float = 0.0) -> None:
        self.requested = False
        self.signal_name: Optional[str] = None
        self.timeout_s = timeout_s
        self.timed_out = False
        self.leaving = False  # set by the loop's cleanup: further signals must not cut it short
        self._raised = False
        self._cancel = threading.Event()  # restore() stops the timers
        self._previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if not self.requested:
            self.requested = True
            self.signal_name = name
            limit = f" (at most {self.timeout_s:.0f} s)" if self.timeout_s > 0 else ""
            print(f"m2po: received {name}; will checkpoint and stop after the current step{limit}",
                  file=sys.stderr, flush=True)
            if self.timeout_s > 0:
                threading.Thread(target=self._deadline, args=(signum,), daemon=True, name="m2po-stop-timeout").start()
            return
        if self._raised:
            return  # already leaving
        self._raised = True
        if self.leaving:  # cleanup is what leaving now would do; only make sure it cannot hang
            threading.Thread(target=self._hard_exit, args=(signum,), daemon=True, name="m2po-hard-exit").start()
            return
        why = (f"the stop did not finish within checkpoint.stop_timeout_s = {self.timeout_s:.0f} s"
               if self.timed_out else f"second {name}")
        threading.Thread(target=self._hard_exit, args=(signum,), daemon=True, name="m2po-hard-exit").start()
        raise StopNow(f"{why}: exiting now without a new checkpoint", signum)

    def _deadline(self, signum: int) -> None:
        if self._cancel.wait(self.timeout_s):
            return
        if not self._raised:
            self.timed_out = True
            # a real signal to the main thread: it also interrupts a blocking wait, which interrupt_main cannot
            signal.pthread_kill(threading.main_thread().ident, signum)
        self._hard_exit(signum)  # in case the main thread never gets to run the handler

    def _hard_exit(self, signum: int) -> None:
        if self._cancel.wait(self.HARD_EXIT_GRACE_S):
            return
        print(f"m2po: still running {self.HARD_EXIT_GRACE_S:.0f} s after the forced stop; exiting hard "
              f"(checkpoints stay consistent; the run's processes are reaped)", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    def restore(self) -> None:
        """Reinstall the handlers that were there before (and stop the timers)."""
        self._cancel.set()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def install(self, signals: Iterable[int] = (signal.SIGTERM, signal.SIGUSR1)) -> "StopFlag":
        """(Re)install the handlers; call again after anything that installs its own (ray.init does, for
        SIGTERM). Main thread only."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("install_sigterm_flag must be called from the main thread (Python delivers "
                               "signals only there); call it in the training loop's process before starting threads")
        for sig in signals:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)
        return self


def install_sigterm_flag(signals: Iterable[int] = (signal.SIGTERM, signal.SIGUSR1), timeout_s: float = 0.0) -> StopFlag:
    """Install handlers for `signals` (default SIGTERM and SIGUSR1) that set a flag. Main thread only."""
    return StopFlag(timeout_s).install(signals)
