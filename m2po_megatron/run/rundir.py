"""The run directory's safety rules: one process per directory, a new run never clobbers an old one, and a
resumed run's metrics end where its checkpoint does.

- `RunDirLock`: an advisory lock (`RUN_DIR/.lock`, flock) held by the driver for its lifetime; the kernel
  drops it when the process dies, even by SIGKILL, so a stale lock never blocks a restart.
- `refuse_if_used`: a fresh start in a directory that holds another run (its config, metrics or checkpoints)
  stops before anything is written, naming `--resume auto` and `--overwrite`.
- `move_aside`: `--overwrite` renames the old run to RUN_DIR.replaced-TIME (kept, never deleted).
- `truncate_metrics`: on resume, rows after the checkpoint's step go (they are recomputed), so every step
  appears once in metrics.jsonl.
- `check_resume`: a resume that would change what the run is (its algorithm, staleness, model, layout, data...;
  run/config_guard.py) stops before anything starts, naming each key, unless `--allow-change` allows it.
- `check_run_dir` (reads only, before anything starts) and `claim_run_dir` (the lock, --overwrite, resume
  truncation) apply these rules for `m2po train`; `record_start` writes RUN_DIR/config.yaml (the latest
  config) and appends to RUN_DIR/config_history.jsonl; `record_placement` writes RUN_DIR/placement.json.
"""
from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from m2po_megatron.config import ConfigError, redact, save_resolved
from m2po_megatron.run.checkpoint import checkpoint_step
from m2po_megatron.run.config_guard import diff, refusal, refused
from m2po_megatron.run.config_history import append_history, config_at

LOCK = ".lock"


class RunDirLock:
    """Exclusive, non-blocking; ConfigError naming the holder when another process has it."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self._fd: Optional[int] = None

    def acquire(self) -> "RunDirLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(f"run directory {self.path.parent} is in use by another m2po process (pid {holder}); "
                              f"wait for it to finish, stop it, or choose another run.name") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def describe_run(run_dir: Path) -> Optional[str]:
    """What of a run the directory holds ("metrics.jsonl with 16 rows (last step 16), checkpoints step 8,
    16"), or None when it holds none."""
    run_dir = Path(run_dir)
    found = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        steps = _steps(metrics)
        found.append(f"metrics.jsonl with {len(steps)} rows" + (f" (last step {steps[-1]})" if steps else ""))
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) if (run_dir / "checkpoints").is_dir() else []
    if ckpts:
        found.append("checkpoints " + ", ".join(ckpts[-3:]))
    if (run_dir / "config.yaml").is_file():
        found.append("config.yaml")
    return ", ".join(found) or None


def refuse_if_used(run_dir: Path) -> None:
    """A fresh start in a directory holding another run: ConfigError (exit 2) before anything is written."""
    held = describe_run(run_dir)
    if held:
        raise ConfigError(f"run directory {run_dir} holds another run ({held}); continue it with `--resume auto`, "
                          f"start over with `--overwrite` (the old run is moved to {run_dir.name}.replaced-TIME), "
                          f"or choose another run.name")


def move_aside(run_dir: Path) -> Optional[Path]:
    """`--overwrite`: rename the old run's directory aside (kept, never deleted). Returns where it went."""
    run_dir = Path(run_dir)
    if not run_dir.exists() or not describe_run(run_dir):
        return None
    dst = run_dir.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    n = 1
    while dst.exists():
        dst = dst.with_name(f"{run_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
        n += 1
    os.rename(run_dir, dst)
    return dst


def _steps(path: Path) -> list[int]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def truncate_metrics(path: Path, last_step: int) -> int:
    """Keep the rows of steps <= last_step (all rows go when last_step is 0: step 0 is re-evaluated);
    unreadable lines (a row cut by a kill) go too. Atomic. Returns the number of rows removed."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, removed = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            removed += 1
            continue
        if last_step > 0 and step <= last_step:
            kept.append(line)
        else:
            removed += 1
    if removed:
        tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return removed


def check_run_dir(cfg: DictConfig, rdir: Path, ckpts):
    """The checkpoint to resume from (None: start fresh), checked, and the refusal to start a new run over
    another one. Reads only."""
    if cfg.run.overwrite:  # start over: whatever is there is moved aside (claim_run_dir)
        return None
    resume_from = ckpts.resolve_resume(cfg.run.resume)  # a damaged checkpoint is found here (RunStateError)
    if cfg.run.resume == "none":
        refuse_if_used(rdir)
    return resume_from


def check_resume(cfg: DictConfig, resume_from, allowed: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Compare the config the checkpoint was trained with (its run's config_history.jsonl, else config.yaml)
    with `cfg`: guarded changes not in `allowed` raise ConfigError (exit 2) naming each key; safe and allowed
    ones are printed. Returns the guarded keys that changed (allowed), for the history. Reads only."""
    if resume_from is None:
        return ()
    from omegaconf import OmegaConf

    from m2po_megatron.config import RunConfig

    step = checkpoint_step(resume_from)
    src = Path(resume_from).parent.parent  # RUN_DIR/checkpoints/step_XXXXXXX
    old, where = config_at(src, step)
    if old is None:
        print(f"[m2po] {where} is missing: the settings checkpoint {resume_from} was trained with are unknown, "
              f"so the resume's changes were not checked", flush=True)
        return ()
    changes = diff(old, redact(cfg), defaults=redact(OmegaConf.structured(RunConfig)))
    if stop := refused(changes, allowed):
        raise ConfigError(refusal(stop, f"{src} from step {step}"))
    for c in changes:
        if c.key not in ("run.resume", "run.overwrite"):  # how this start was asked for, not a change
            print(f"[m2po] resume changes {c.text()} ({'safe' if c.safe else 'allowed by --allow-change'})",
                  flush=True)
    return tuple(c.key for c in changes if not c.safe)


def record_start(cfg: DictConfig, rdir: Path, start_step: int, resume_from, allowed: tuple[str, ...] = ()) -> None:
    """RUN_DIR/config.yaml (the latest config) and this start's entry in RUN_DIR/config_history.jsonl."""
    save_resolved(cfg, rdir)
    append_history(rdir, redact(cfg), start_step, resume_from, allowed)


def claim_run_dir(cfg: DictConfig, rdir: Path, ckpts, resume_from):
    """Take the directory's lock; --overwrite moves an old run aside; a resume drops what came after its
    checkpoint (metrics rows, newer checkpoints), so every step is logged once."""
    if cfg.run.overwrite and rdir.exists():
        old = RunDirLock(rdir).acquire()  # not while another process runs in it
        moved = move_aside(rdir)
        old.release()
        if moved:
            print(f"[m2po] --overwrite: the previous run in {rdir} was moved to {moved}", flush=True)
    lock = RunDirLock(rdir).acquire()
    step = checkpoint_step(resume_from)
    if resume_from is not None and Path(resume_from).parent.resolve() == ckpts.root.resolve():
        for p in ckpts.retire_newer(step):
            print(f"[m2po] resuming from step {step}: the later checkpoint {p.name} is kept aside, not resumed",
                  flush=True)
    dropped = truncate_metrics(rdir / "metrics.jsonl", step if resume_from is not None else 0)
    if dropped:
        print(f"[m2po] metrics.jsonl: {dropped} row(s) after step {step} removed (they are recomputed)", flush=True)
    if resume_from is not None:
        print(f"[m2po] resuming from {resume_from} (step {step})", flush=True)
    return lock


def record_placement(rdir: Path, role: str, entries: list[dict]) -> None:
    """One `[placement]` line per rank/server (the Slurm tests read them) and RUN_DIR/placement.json."""
    for e in entries:
        print(f"[placement] role={role} " + " ".join(f"{k}={v}" for k, v in e.items()), flush=True)
    path = rdir / "placement.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[role] = entries
    path.write_text(json.dumps(data, indent=1))
