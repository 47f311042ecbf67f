"""What a run's timeline (RUN_DIR/trace.json, infra/trace.py) says about utilisation: for each trainer rank
and each rollout server the fraction of the run it was busy, and where the loop's time went.

Busy is the union of a row's spans, so overlapping requests on one server count once: a server is busy while
at least one request is in flight on it (the client's view; it does not see how full the server's batch
is). The CPU server also traces its engine (`rollout server :PORT engine`): busy there is computing. The
window is the first span's start to the last span's end over the whole run."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from m2po_megatron.infra.trace import base_row, read_trace

__all__ = ["format_utilisation", "union_seconds", "utilisation"]

# the loop's own spans (tid "loop"), in the order they are reported
LOOP_PHASES = ("wait_rollout", "train_step", "weight_sync", "eval", "checkpoint")
# a trainer rank is busy inside these (its "main" row; the "phases" row splits train_step)
RANK_SPANS = ("train_step", "logprob_pass", "sync_weights", "checkpoint")


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (any units)."""
    total, end = 0.0, None
    start = None
    for a, b in sorted(intervals):
        if end is None or a > end:
            if end is not None:
                total += end - start
            start, end = a, b
        else:
            end = max(end, b)
    if end is not None:
        total += end - start
    return total


def utilisation(run_dir: str | Path) -> dict:
    """{"window_s", "loop": {phase: fraction of the window}, "components": [{"component", "busy_frac",
    "spans"}], "dropped": {category: spans sampled away}}. FileNotFoundError when the run has no timeline."""
    doc = read_trace(run_dir)
    events = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    if not events:
        return {"window_s": 0.0, "loop": {}, "components": [], "dropped": doc.get("otherData", {}).get("dropped", {})}
    t0 = min(e["ts"] for e in events)
    window_us = max(e["ts"] + e["dur"] for e in events) - t0
    rows: dict[str, list] = defaultdict(list)
    loop: dict[str, list] = defaultdict(list)
    for e in events:
        iv = (e["ts"], e["ts"] + e["dur"])
        proc, tid = names.get(e["pid"], str(e["pid"])), base_row(e.get("tid"))
        if e.get("cat") == "request":
            rows[f"server {tid}"].append(iv)
        elif e.get("cat") == "engine":  # the CPU server's own decode steps and prefills
            rows[f"{proc} engine"].append(iv)
        elif proc.startswith("trainer") and tid == "main" and e["name"] in RANK_SPANS:
            rows[proc].append(iv)
        elif proc == "loop" and tid == "loop" and e["name"] in LOOP_PHASES:
            loop[e["name"]].append(iv)
    frac = lambda ivs: union_seconds(ivs) / window_us if window_us > 0 else 0.0  # noqa: E731
    return {"window_s": window_us / 1e6,
            "loop": {p: frac(loop[p]) for p in LOOP_PHASES if p in loop},
            "components": [{"component": k, "busy_frac": frac(v), "spans": len(v)} for k, v in sorted(rows.items())],
            "dropped": doc.get("otherData", {}).get("dropped", {})}


def format_utilisation(u: dict) -> str:
    """The summary as text, for `m2po plot`."""
    lines = [f"run timeline: {u['window_s']:.1f} s"]
    if u["loop"]:
        lines.append("  loop: " + ", ".join(f"{k} {100 * v:.1f} %" for k, v in u["loop"].items()))
    for c in u["components"]:
        lines.append(f"  {c['component']}: busy {100 * c['busy_frac']:.1f} %, idle "
                     f"{100 * (1 - c['busy_frac']):.1f} % ({c['spans']} spans)")
    if any(u["dropped"].values()):
        lines.append("  sampled away (logging.trace_limit): "
                     + ", ".join(f"{k} {v}" for k, v in u["dropped"].items() if v))
    return "\n".join(lines)
