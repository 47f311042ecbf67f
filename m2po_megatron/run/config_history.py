"""RUN_DIR/config_history.jsonl: the resolved config (redacted) of every start and resume of a run, with the
step it started from. `config.yaml` holds the latest one; the history says which config trained which steps.

One JSON object per line, appended (a line cut by a kill is skipped when read):
    {"start_step": 40, "time": "2026-12-06T10:00:00", "resumed_from": ".../checkpoints/step_0000040",
     "allowed": ["algo.name"], "config": {...}}
An entry that starts at step s covers steps s+1 onwards, until an entry that starts at or before the
steps it covered: a resume from an earlier checkpoint supersedes what was trained after that checkpoint
(those steps are recomputed, like their metrics rows). A run that predates the history gets an entry for
step 0 from its config.yaml when it is first resumed.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

HISTORY = "config_history.jsonl"


def history_path(rdir: Path) -> Path:
    return Path(rdir) / HISTORY


def read_history(rdir: Path) -> list[dict]:
    """Every entry in the order written; unreadable lines (a write cut by a kill) are skipped."""
    path = history_path(rdir)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if isinstance(e, dict) and isinstance(e.get("config"), dict) and isinstance(e.get("start_step"), int):
            out.append(e)
    return out


def effective(entries: list[dict]) -> list[dict]:
    """The entries whose steps still stand, by ascending start step: each entry drops the earlier-written
    ones that start at or after its own start."""
    kept: list[dict] = []
    for e in entries:
        kept = [k for k in kept if k["start_step"] < e["start_step"]] + [e]
    return kept


def _config_yaml(rdir: Path) -> Optional[dict]:
    path = Path(rdir) / "config.yaml"
    try:
        doc = yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        return None
    return doc if isinstance(doc, dict) else None


def config_at(rdir: Path, step: int) -> tuple[Optional[dict], str]:
    """The config a resume from the checkpoint of `step` continues: the latest standing entry that starts
    at or before it (a resume that already changed the run from that step counts), else config.yaml.
    Returns (config or None, where it came from)."""
    for e in reversed(effective(read_history(rdir))):
        if e["start_step"] <= step:
            return e["config"], f"{history_path(rdir)} (the start at step {e['start_step']})"
    cfg = _config_yaml(rdir)
    return cfg, str(Path(rdir) / "config.yaml")


def append_history(rdir: Path, config: dict, start_step: int, resumed_from: Optional[Path] = None,
                   allowed: tuple[str, ...] = ()) -> Path:
    """Add this start's entry (config: plain and redacted). A resumed run without a history first gets
    its config.yaml as the entry of step 0."""
    path = history_path(rdir)
    entries = []
    if not path.is_file() and start_step > 0 and (old := _config_yaml(rdir)) is not None:
        entries.append({"start_step": 0, "time": None, "resumed_from": None, "allowed": [], "config": old,
                        "note": "config.yaml of the run before config_history.jsonl was kept"})
    entries.append({"start_step": int(start_step), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "resumed_from": str(resumed_from) if resumed_from is not None else None,
                    "allowed": list(allowed), "config": config})
    torn = path.is_file() and path.stat().st_size and not path.read_bytes().endswith(b"\n")
    with open(path, "a") as f:
        # a line cut by a kill must stay a line of its own (skipped), not swallow this entry
        f.write(("\n" if torn else "") + "".join(json.dumps(e, default=str) + "\n" for e in entries))
        f.flush()
        os.fsync(f.fileno())
    return path


def segments(rdir: Path, last_step: int) -> list[tuple[int, int, dict]]:
    """(first step, last step, config) of each standing entry that trained a step, up to `last_step`
    (the run's last logged step). The first segment counts from step 1; [] without a history."""
    kept = effective(read_history(rdir))
    out = []
    for i, e in enumerate(kept):
        first = e["start_step"] + 1
        last = kept[i + 1]["start_step"] if i + 1 < len(kept) else last_step
        if first <= last:
            out.append((first, last, e["config"]))
    return out


def label_over_time(rdir: Path, value: Callable[[dict], Any], last_step: int) -> Optional[str]:
    """"m2po (steps 1-40) -> grpo (steps 41-60)" when `value(config)` changed during the run, else None
    (one value, or no history). Consecutive segments with the same value are merged."""
    parts: list[list] = []
    for first, last, cfg in segments(rdir, last_step):
        v = value(cfg)
        if parts and parts[-1][0] == v:
            parts[-1][2] = last
        else:
            parts.append([v, first, last])
    if len(parts) < 2:
        return None
    return " -> ".join(f"{v} (steps {a}-{b})" for v, a, b in parts)
