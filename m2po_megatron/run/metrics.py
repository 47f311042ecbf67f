"""One metrics API for a run: `metrics.jsonl` in the run directory, wandb (online, offline or disabled),
and console progress with rate and ETA that stays readable in non-TTY CI logs.

Secrets never reach a sink: keys that look like secrets are dropped from logged config and metrics.
"""
from __future__ import annotations

import gzip
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

from m2po_megatron.config import is_secret, redact


def _plain(v: Any) -> Any:
    if isinstance(v, (list, tuple)):  # e.g. a step's per-update metrics
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items() if not is_secret(k)}
    if hasattr(v, "item") and callable(v.item):  # torch / numpy scalars
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; keep them visible rather than dropping the key
    return v


class MetricsLogger:
    """Write one JSON object per step to RUN_DIR/metrics.jsonl and, if enabled, to wandb.

    wandb mode comes from WANDB_MODE if set, else from `wandb_mode` (online | offline | disabled); offline
    runs are written under RUN_DIR/wandb."""

    def __init__(self, run_dir: str | Path, *, config: Optional[dict] = None, wandb_mode: str = "disabled",
                 project: str = "m2po-megatron", entity: Optional[str] = None, name: Optional[str] = None,
                 resume: bool = False, resume_step: Optional[int] = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = open(self.path, "a" if resume else "w", buffering=1)
        self.wandb_mode = os.environ.get("WANDB_MODE", wandb_mode)
        self._wandb = None
        if self.wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_DIR", str(self.run_dir))
            os.environ.setdefault("WANDB_SILENT", "true")
            kw = dict(project=project, entity=entity, name=name or self.run_dir.name, dir=str(self.run_dir),
                      mode=self.wandb_mode, config=redact(config or {}))
            run_id = self._wandb_id(resume)
            self._wandb = None
            if resume and resume_step is not None and self.wandb_mode == "online":
                # rewind the wandb run to the checkpoint's step, as metrics.jsonl was truncated to it
                try:
                    self._wandb = wandb.init(resume_from=f"{run_id}?_step={int(resume_step)}", **kw)
                except Exception as e:  # noqa: BLE001 - a server without rewind: resume; wandb drops older steps
                    warnings.warn(f"wandb could not rewind run {run_id} to step {resume_step} ({e}); resuming it, "
                                  "rows already logged for later steps stay in wandb", stacklevel=2)
            if self._wandb is None:
                self._wandb = wandb.init(resume="allow" if resume else None, id=run_id, **kw)

    def _wandb_id(self, resume: bool) -> Optional[str]:
        # A stable id per run directory, so a resumed run continues the same wandb run.
        idf = self.run_dir / ".wandb_id"
        if resume and idf.exists():
            return idf.read_text().strip()
        import uuid

        rid = uuid.uuid4().hex[:12]
        idf.write_text(rid)
        return rid

    def log(self, metrics: dict, step: int) -> dict:
        row = {"step": int(step)}
        row.update({k: _plain(v) for k, v in metrics.items() if not is_secret(k)})
        self._file.write(json.dumps(row, sort_keys=False) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=int(step))
        return row

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def metrics_path(run_dir: str | Path) -> Path:
    """RUN_DIR/metrics.jsonl, or its archived copy metrics.jsonl.gz when only that is there (finished runs
    committed with their results: tools/archive_runs.py)."""
    plain = Path(run_dir) / "metrics.jsonl"
    packed = plain.with_name("metrics.jsonl.gz")
    return packed if not plain.is_file() and packed.is_file() else plain


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl (or .jsonl.gz), in order. A truncated last line (a run killed mid-write) is
    skipped with a warning; any other line that is not a JSON object with a 'step' raises, naming the file
    and line."""
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "rt", errors="replace") as f:
            lines = f.read().splitlines()
    else:
        lines = path.read_text(errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError("not a JSON object with a 'step' key")
            int(row["step"])
        except (ValueError, TypeError) as e:
            if i == last:
                warnings.warn(f"{path}:{i + 1}: ignoring a truncated last line (run killed mid-write?)",
                              stacklevel=2)
                continue
            raise ValueError(f"{path}:{i + 1}: bad metrics line ({e}); each line must be a JSON object "
                             f"with an integer 'step'") from None
        rows.append(row)
    return rows


class Progress:
    """Progress with rate and ETA. On a TTY a rich live bar; otherwise one plain line at most every
    `min_interval_s` (and at the end), so CI logs stay short and readable."""

    def __init__(self, total: int, desc: str = "", *, unit: str = "it", stream=None,
                 min_interval_s: float = 10.0, force_plain: Optional[bool] = None, initial: int = 0):
        """`initial`: units already done (a resumed run: "5/16", and the rate counts this session's only)."""
        self.total, self.desc, self.unit = total, desc, unit
        self.stream = stream or sys.stderr
        self.initial = self.done = initial
        self.t0 = time.monotonic()
        self._last = -math.inf
        self.min_interval_s = min_interval_s
        tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.plain = (not tty) if force_plain is None else force_plain
        self._rich = None
        if not self.plain:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                       TextColumn, TimeElapsedColumn, TimeRemainingColumn)
            from rich.console import Console

            self._rich = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                                      TimeRemainingColumn(), console=Console(file=self.stream))
            self._task = self._rich.add_task(desc, total=total, completed=initial, rate="")
            self._rich.start()
        self.postfix = ""

    def rate(self) -> float:
        dt = time.monotonic() - self.t0
        return (self.done - self.initial) / dt if dt > 0 else 0.0

    def eta_s(self) -> float:
        r = self.rate()
        return (self.total - self.done) / r if r > 0 else float("inf")

    def line(self) -> str:
        eta = self.eta_s()
        eta_s = "?" if not math.isfinite(eta) else time.strftime("%H:%M:%S", time.gmtime(eta))
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return (f"{self.desc} {self.done}/{self.total} ({pct:.0f}%) {self.rate():.2f} {self.unit}/s "
                f"eta {eta_s}" + (f" | {self.postfix}" if self.postfix else ""))

    def update(self, n: int = 1, postfix: str = "") -> None:
        self.done += n
        if postfix:
            self.postfix = postfix
        if self._rich is not None:
            self._rich.update(self._task, completed=self.done, rate=f"{self.rate():.2f} {self.unit}/s",
                              description=f"{self.desc} {self.postfix}".strip())
            return
        now = time.monotonic()
        if now - self._last >= self.min_interval_s or self.done >= self.total:
            self._last = now
            print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
