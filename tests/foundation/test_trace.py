"""The run timeline: Chrome trace events from several writers, bounded by sampling, merged into trace.json,
read back after a kill, and the utilisation summary drawn from it."""
import json
import time

import pytest

from m2po_megatron.infra import trace
from m2po_megatron.infra.trace import TraceWriter, merge_trace, misnested, read_trace
from m2po_megatron.sweep.timeline import union_seconds, utilisation


@pytest.fixture(autouse=True)
def _no_writer_left():
    yield
    trace.close_trace()


def test_spans_of_two_processes_merge_into_chrome_trace_events(tmp_path):
    loop = TraceWriter(tmp_path / "trace" / "loop.jsonl", "loop")
    rank = TraceWriter(tmp_path / "trace" / "rank0.jsonl", "trainer rank 0")
    t = time.perf_counter()
    loop.complete("train_step", "loop", t, t + 0.5, tid="loop", args={"step": 1})
    rank.complete("train_step", "train", t + 0.1, t + 0.4)
    loop.close()
    rank.close()
    out = merge_trace(tmp_path)
    doc = json.loads(out.read_text())  # one JSON document, as Perfetto and chrome://tracing load it
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["cat"], e["tid"]) for e in xs] == [("train_step", "loop", "loop"), ("train_step", "train", "main")]
    assert xs[0]["dur"] == pytest.approx(5e5, abs=1) and xs[1]["ts"] - xs[0]["ts"] == pytest.approx(1e5, abs=20)
    assert abs(xs[0]["ts"] / 1e6 - time.time()) < 60  # epoch microseconds: processes line up
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"loop", "trainer rank 0"}
    assert xs[0]["args"] == {"step": 1}


def test_sampling_bounds_each_category_and_counts_what_it_dropped(tmp_path):
    w = TraceWriter(tmp_path / "trace" / "p.jsonl", "p", limit=10)
    for i in range(1000):
        w.complete("generate", "request", i, i + 0.5)
    for i in range(5):
        w.complete("train_step", "loop", i, i + 1)
    w.close()
    doc = read_trace(tmp_path)
    kept = [e for e in doc["traceEvents"] if e.get("cat") == "request"]
    assert len(kept) <= 10 * (1 + 7 / 2) + 1 and len(kept) + doc["otherData"]["dropped"]["request"] == 1000
    assert len([e for e in doc["traceEvents"] if e.get("cat") == "loop"]) == 5  # other categories untouched
    assert kept[0]["ts"] < kept[-1]["ts"] and kept[-1]["ts"] / 1e6 > kept[0]["ts"] / 1e6 + 800  # spread, not a prefix


def test_killed_writer_torn_line_and_newer_parts(tmp_path):
    w = TraceWriter(tmp_path / "trace" / "loop.jsonl", "loop")
    w.complete("wait_rollout", "loop", 0.0, 1.0, tid="loop")
    w.flush()  # then killed: no close()
    with open(tmp_path / "trace" / "loop.jsonl", "a") as f:
        f.write('{"ph": "X", "name": "tor')
    doc = read_trace(tmp_path)
    assert [e["name"] for e in doc["traceEvents"] if e["ph"] == "X"] == ["wait_rollout"]
    merge_trace(tmp_path)
    w2 = TraceWriter(tmp_path / "trace" / "loop.jsonl", "loop")  # a resumed run appends
    w2.complete("train_step", "loop", 2.0, 3.0, tid="loop")
    w2.close()
    time.sleep(0.01)
    names = [e["name"] for e in read_trace(tmp_path)["traceEvents"] if e["ph"] == "X"]
    assert names == ["wait_rollout", "train_step"]  # the parts are newer than trace.json


def test_span_is_free_without_a_writer_and_records_on_exceptions(tmp_path):
    with trace.span("x", "loop") as args:
        args["ok"] = 1
    assert not (tmp_path / "trace").exists()
    trace.open_trace(tmp_path / "trace" / "loop.jsonl", "loop")
    with pytest.raises(RuntimeError):
        with trace.span("eval", "eval", tid="loop", step=3):
            raise RuntimeError("boom")
    trace.close_trace()
    (ev,) = [e for e in read_trace(tmp_path)["traceEvents"] if e["ph"] == "X"]
    assert ev["name"] == "eval" and ev["args"] == {"step": 3}


def test_bad_limit_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="logging.trace_limit"):
        TraceWriter(tmp_path / "t.jsonl", "p", limit=0)


def test_no_timeline_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="logging.trace=false"):
        read_trace(tmp_path)


def test_union_and_utilisation(tmp_path):
    assert union_seconds([(0, 2), (1, 3), (5, 6)]) == 4 and union_seconds([]) == 0
    loop = TraceWriter(tmp_path / "trace" / "loop.jsonl", "loop")
    rank = TraceWriter(tmp_path / "trace" / "rank0.jsonl", "trainer rank 0")
    # 10 s: the loop waits 0-6 and trains 6-10; the server has two overlapping requests 0-4 and 2-6
    loop.complete("wait_rollout", "loop", 0.0, 6.0, tid="loop")
    loop.complete("train_step", "loop", 6.0, 10.0, tid="loop")
    loop.complete("generate", "request", 0.0, 4.0, tid="http://10.0.0.1:30000")
    loop.complete("generate", "request", 2.0, 6.0, tid="http://10.0.0.1:30000")
    rank.complete("train_step", "train", 6.5, 9.5)
    rank.complete("forward_backward", "train", 6.5, 9.0, tid="phases")  # inside train_step: not counted twice
    loop.close()
    rank.close()
    u = utilisation(tmp_path)
    assert u["window_s"] == pytest.approx(10)
    assert u["loop"] == pytest.approx({"wait_rollout": 0.6, "train_step": 0.4})
    comp = {c["component"]: c["busy_frac"] for c in u["components"]}
    assert comp == pytest.approx({"server http://10.0.0.1:30000": 0.6, "trainer rank 0": 0.3})


def test_overlapping_spans_of_one_row_go_to_extra_rows_so_every_row_nests(tmp_path):
    """Concurrent requests on one server's row overlap without nesting; the merged timeline moves each to
    the first row of that server where it nests, and keeps nested and back-to-back spans where they were."""
    w = TraceWriter(tmp_path / "trace" / "server.jsonl", "server")
    t = time.perf_counter()
    for i, (a, b) in enumerate([(0.0, 1.0), (0.5, 1.5), (0.7, 0.9), (1.2, 2.0), (1.0, 1.1), (0.6, 1.6)]):
        w.complete(f"req{i}", "request", t + a, t + b, tid="http://h:1")
    w.complete("step", "loop", t, t + 1.0, tid="loop")
    w.complete("inner", "loop", t + 0.25, t + 0.5, tid="loop")
    w.complete("next", "loop", t + 1.0, t + 2.0, tid="loop")  # back to back with "step"
    w.close()
    doc = json.loads(merge_trace(tmp_path).read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    raw = [json.loads(line) for line in (tmp_path / "trace" / "server.jsonl").read_text().splitlines()]
    assert misnested([e for e in raw if e.get("ph") == "X"])  # as written, the server row misnests
    assert misnested(xs) == []
    row = {e["name"]: e["tid"] for e in xs}
    assert row == {"req0": "http://h:1", "req1": "http://h:1 #2", "req2": "http://h:1", "req3": "http://h:1",
                   "req4": "http://h:1", "req5": "http://h:1 #3", "step": "loop", "inner": "loop", "next": "loop"}
    assert len(xs) == 9  # none lost
