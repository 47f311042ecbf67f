"""Run timelines: spans in Chrome's trace-event format (complete events, `"ph": "X"`), which Perfetto and
chrome://tracing open.

Each process of a run (the loop, each trainer rank) appends its spans to its own part file,
RUN_DIR/trace/<process>.jsonl, one JSON event per line, so a killed run keeps what it wrote and no process
waits on another. `merge_trace` joins the parts into RUN_DIR/trace.json at the end of the run (and `m2po plot`
does it again if the parts are newer). Times are wall-clock microseconds since the epoch, so processes on one
node line up exactly and processes on NTP-synced nodes to about a millisecond.

Bounded in size: per category, the first `limit` spans are kept, then one in 2 of the next `limit`, one in 4
of the `2 limit` after, and so on: `limit / 2` more per doubling, spread over the whole run (a run of N spans
in a category keeps about limit x (1 + log2(N / limit) / 2)); every dropped span is counted in the part's last line and in
trace.json's `otherData`. Bounded in cost: a span is a perf_counter pair and a dict; lines are written in
batches of 256 or every 2 s (benchmarks/bench_trace.py measures the cost per span and per step).

One writer per process, set by `open_trace` (the loop, a trainer rank); `span` and `complete` do nothing
while none is open, so instrumented code needs no flag of its own.
"""
from __future__ import annotations

import json
import os
import threading
import time
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

__all__ = ["TraceWriter", "base_row", "close_trace", "complete", "misnested", "enabled", "flush", "merge_trace", "open_from_env", "open_trace",
           "read_trace", "span", "trace_env", "DEFAULT_LIMIT"]

DEFAULT_LIMIT = 20_000  # spans per category kept in full before sampling starts
_FLUSH_EVERY = 256
_FLUSH_S = 2.0  # a process killed without close() (ray.kill) loses at most this much


class TraceWriter:
    """Spans of one process to `path` (JSON lines). `process`: its name in the viewer (pid row)."""

    def __init__(self, path: str | Path, process: str, limit: int = DEFAULT_LIMIT):
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"trace limit must be a positive integer, got {limit!r} (logging.trace_limit)")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.process, self.limit = process, limit
        # perf_counter -> epoch microseconds, fixed once, so spans of one process never reorder
        self._offset_us = time.time() * 1e6 - time.perf_counter() * 1e6
        # one row per logical process, stable across a resume (the OS pid is in the metadata)
        self._pid = zlib.crc32(process.encode()) & 0x7FFFFFFF
        self._seen: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self._buf: list[str] = []
        self._flushed = time.monotonic()
        self._lock = threading.Lock()  # the generation thread and the loop both write
        torn = self.path.is_file() and self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n")
        self._file = open(self.path, "a", encoding="utf-8")
        if torn:  # a killed writer's half line: start ours on a line of its own
            self._file.write("\n")
        self._emit({"ph": "M", "name": "process_name", "pid": self._pid, "args": {"name": process,
                                                                                  "os_pid": os.getpid()}})

    def _keep(self, cat: str) -> bool:
        c = self._seen.get(cat, 0)
        self._seen[cat] = c + 1
        # stride 2^k over [limit * 2^(k-1), limit * 2^k): limit / 2 spans per doubling, spread over the run
        stride = 1 if c < self.limit else 1 << min((c // self.limit).bit_length(), 40)
        if c % stride == 0:
            return True
        self.dropped[cat] = self.dropped.get(cat, 0) + 1
        return False

    def complete(self, name: str, cat: str, t0: float, t1: float, tid: str = "main",
                 args: Optional[dict] = None) -> None:
        """A span from perf_counter() t0 to t1 on row `tid` of this process."""
        with self._lock:
            if self._file is None or not self._keep(cat):
                return
            # whole microseconds, start and end rounded alike: a span that ends before the next begins still
            # does after rounding, and a child stays inside its parent (epoch us in a float64 are only
            # 0.25 us apart, so finer rounding would not hold)
            ts = round(t0 * 1e6 + self._offset_us)
            ev = {"ph": "X", "name": name, "cat": cat, "pid": self._pid, "tid": tid, "ts": ts,
                  "dur": max(round(t1 * 1e6 + self._offset_us) - ts, 0)}
            if args:
                ev["args"] = args
            self._emit(ev)

    def _emit(self, ev: dict) -> None:
        self._buf.append(json.dumps(ev, separators=(",", ":")))
        if len(self._buf) >= _FLUSH_EVERY or time.monotonic() - self._flushed > _FLUSH_S:
            self._flush()

    def _flush(self) -> None:
        if self._buf and self._file is not None:
            self._file.write("\n".join(self._buf) + "\n")
            self._file.flush()
        self._buf = []
        self._flushed = time.monotonic()

    def flush(self) -> None:
        with self._lock:
            self._flush()

    def close(self) -> None:
        with self._lock:
            if self._file is None:
                return
            self._emit({"ph": "M", "name": "m2po_dropped", "pid": self._pid, "args": dict(self.dropped)})
            self._flush()
            self._file.close()
            self._file = None


_writer: Optional[TraceWriter] = None


def open_trace(path: str | Path, process: str, limit: int = DEFAULT_LIMIT) -> TraceWriter:
    """Open this process's writer (closing a previous one)."""
    global _writer
    close_trace()
    _writer = TraceWriter(path, process, limit)
    return _writer


# A process the run starts as a subprocess with flags of another program's (the CPU rollout server speaks
# SGLang's) learns where its part goes from the environment.
DIR_ENV, LIMIT_ENV = "M2PO_TRACE_DIR", "M2PO_TRACE_LIMIT"


def trace_env(run_dir: str | Path, limit: int = DEFAULT_LIMIT) -> dict[str, str]:
    """The environment that makes `open_from_env` write into RUN_DIR's timeline."""
    return {DIR_ENV: str(Path(run_dir) / "trace"), LIMIT_ENV: str(limit)}


def open_from_env(part: str, process: str) -> Optional[TraceWriter]:
    """Open this process's writer at $M2PO_TRACE_DIR/<part>.jsonl when the variable is set; else None."""
    d = os.environ.get(DIR_ENV)
    if not d:
        return None
    return open_trace(Path(d) / f"{part}.jsonl", process, int(os.environ.get(LIMIT_ENV) or DEFAULT_LIMIT))


def close_trace() -> None:
    global _writer
    if _writer is not None:
        _writer.close()
        _writer = None


def enabled() -> bool:
    """Whether this process has a writer open (for spans whose args cost something to compute)."""
    return _writer is not None


def flush() -> None:
    """Write this process's buffered spans now (a trainer rank after each call: ray.kill skips close)."""
    if _writer is not None:
        _writer.flush()


def complete(name: str, cat: str, t0: float, t1: float, tid: str = "main", args: Optional[dict] = None) -> None:
    """A finished span (perf_counter times) in this process's trace, if one is open."""
    w = _writer
    if w is not None:
        w.complete(name, cat, t0, t1, tid, args)


@contextmanager
def span(name: str, cat: str, tid: str = "main", **args) -> Iterator[dict]:
    """Time the block as a span; the yielded dict is its args (fill in results). An exception still ends it."""
    if _writer is None:
        yield args
        return
    t0 = time.perf_counter()
    try:
        yield args
    finally:
        complete(name, cat, t0, time.perf_counter(), tid, args)


def read_trace(run_dir: str | Path) -> dict:
    """The run's events as {"traceEvents": [...], "otherData": {"dropped": {cat: n}}}: trace.json, or the part
    files when they are newer (a run still going, or killed before it merged). FileNotFoundError naming the
    paths when there is neither; a torn last line of a part (a kill mid-write) is skipped."""
    rdir = Path(run_dir)
    merged, parts = rdir / "trace.json", _parts(rdir)
    newest_part = max((p.stat().st_mtime for p in parts), default=None)
    if merged.is_file() and (newest_part is None or merged.stat().st_mtime > newest_part):
        with open(merged, encoding="utf-8") as f:
            return json.load(f)
    if not parts:
        raise FileNotFoundError(f"no run timeline in {rdir}: neither {merged} nor {rdir / 'trace'}/*.jsonl "
                                f"(runs write one unless logging.trace=false)")
    return _join(parts)


def merge_trace(run_dir: str | Path) -> Optional[Path]:
    """Write RUN_DIR/trace.json from the part files (atomically); None when there are none."""
    rdir = Path(run_dir)
    parts = _parts(rdir)
    if not parts:
        return None
    out = rdir / "trace.json"
    tmp = out.with_suffix(".json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_join(parts), f, separators=(",", ":"))
    os.replace(tmp, out)
    return out


def _parts(rdir: Path) -> list[Path]:
    d = rdir / "trace"
    return sorted(d.glob("*.jsonl")) if d.is_dir() else []


def _join(parts: list[Path]) -> dict:
    events, dropped = [], {}
    for p in parts:
        for line in p.read_text(encoding="utf-8").splitlines():
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if ev.get("name") == "m2po_dropped":
                for k, v in ev.get("args", {}).items():
                    dropped[k] = dropped.get(k, 0) + int(v)
            else:
                events.append(ev)
    events.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0), -e.get("dur", 0)))
    return {"traceEvents": nest(events), "displayTimeUnit": "ms", "otherData": {"dropped": dropped}}


def misnested(events: list[dict]) -> list[tuple]:
    """The pairs of complete events that break the Trace Event Format's rule for one (pid, tid) row: any two
    slices are disjoint or one contains the other (empty: a viewer shows every slice)."""
    rows: dict = {}
    for e in events:
        if e.get("ph") == "X":
            rows.setdefault((e.get("pid"), e.get("tid")), []).append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
    bad = []
    for row in rows.values():
        row.sort(key=lambda x: (x[0], -x[1]))  # a parent before the children that start with it
        for i, (a0, a1, an) in enumerate(row):
            for b0, b1, bn in row[i + 1:]:
                if b0 >= a1:
                    break  # sorted by start: every later slice starts after this one ends
                if b1 > a1:  # starts inside, ends outside
                    bad.append(((a0, a1, an), (b0, b1, bn)))
    return bad


def base_row(tid) -> str:
    """The row an event was written to, before nest() moved it to an extra row "<tid> #k"."""
    head, sep, k = str(tid).rpartition(" #")
    return head if sep and k.isdigit() else str(tid)


def nest(events: list[dict]) -> list[dict]:
    """Complete ("X") events moved to extra rows "<tid> #2", "#3"... where they overlap without nesting on one
    row (concurrent requests on one server, spans of two threads): the Trace Event Format requires the
    slices of a row to nest, and Perfetto drops those that do not. Each event keeps the first row where it
    fits; events must come sorted by start, longer first on ties (as _join sorts them)."""
    open_ends: dict[tuple, list[list[float]]] = {}  # (pid, tid) -> per lane, the ends of its open slices
    for ev in events:
        if ev.get("ph") != "X":
            continue
        ts, end = ev["ts"], ev["ts"] + ev.get("dur", 0)
        lanes = open_ends.setdefault((ev.get("pid"), ev.get("tid")), [])
        for k, stack in enumerate(lanes + [[]]):
            while stack and stack[-1] <= ts:
                stack.pop()
            if not stack or end <= stack[-1]:  # disjoint from the lane's open slices, or inside the innermost
                if k == len(lanes):
                    lanes.append(stack)
                stack.append(end)
                if k:
                    ev["tid"] = f"{ev.get('tid')} #{k + 1}"
                break
    return events
