"""A run's trace.json written from spans, for the planner's calibration tests: the loop, one trainer rank and
one CPU server, named as a real run's timeline names them (pids 1, 2, 3)."""
import json
from pathlib import Path

PROCESSES = ((1, "loop"), (2, "trainer rank 0"), (3, "rollout server :1234"))
LOOP, TRAINER, SERVER = 1, 2, 3


def span(pid: int, tid: str, cat: str, name: str, a: float, b: float, args=None) -> dict:
    """A complete event from a to b seconds (microseconds on the trace's clock); `args` left out when None."""
    e = {"ph": "X", "pid": pid, "tid": tid, "cat": cat, "name": name, "ts": round(a * 1e6 + 1.7e15, 1),
         "dur": round((b - a) * 1e6, 1)}
    if args is not None:
        e["args"] = args
    return e


def write_trace(run: Path, spans: list[dict]) -> None:
    events = [{"ph": "M", "name": "process_name", "pid": i, "args": {"name": n}} for i, n in PROCESSES]
    (run / "trace.json").write_text(json.dumps({"traceEvents": events + spans, "otherData": {"dropped": {}}}))
