"""What the run timeline (infra/trace.py) costs a step: the cost of one span, times the spans a step of a real
run writes, over that run's step time. A whole-run A/B (`--ab`) is also offered, but on a shared 2-core
machine its noise (several % between identical runs) is larger than the effect, so the ratio above is the
measurement and the A/B a sanity check.

    .venv/bin/python benchmarks/bench_trace.py --from RUN_DIR [--skip 3]
    .venv/bin/python benchmarks/bench_trace.py --ab 2 [--steps 12]    # runs tiny-cpu with the trace on and off

Every span of every process is counted against the step (the loop's, the ranks' and the CPU server's), though
only some lie on the step's critical path: an upper bound of the overhead.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_staleness import REPO, run as run_tiny  # noqa: E402


def span_cost_us(n: int = 100_000) -> dict:
    """Microseconds per `complete` (with small args, as the engine's decode spans) and per `span` block, written
    to a real file; the median of 5 rounds."""
    from m2po_megatron.infra import trace

    out = {}
    with tempfile.TemporaryDirectory() as d:
        for kind in ("complete", "span"):
            rounds = []
            for r in range(5):
                trace.open_trace(Path(d) / f"{kind}{r}.jsonl", "bench", limit=10 * n)
                t0 = time.perf_counter()
                if kind == "complete":
                    for i in range(n):
                        t = time.perf_counter()
                        trace.complete("decode", "engine", t, t, tid="engine", args={"b": 256, "kv": i})
                else:
                    for i in range(n):
                        with trace.span("train_step", "train", seqs=256, tokens=i):
                            pass
                trace.close_trace()
                rounds.append((time.perf_counter() - t0) / n * 1e6)
            out[kind] = statistics.median(rounds)
    return out


def spans_per_step(run_dir: Path, skip: int) -> dict:
    """Spans written per training step after the first `skip`, and the mean step time, from a finished run."""
    from m2po_megatron.infra.trace import read_trace
    from m2po_megatron.run.metrics import read_metrics

    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "time/step" in r]
    spans = [e for e in read_trace(run_dir)["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in spans if e.get("tid") == "loop" and e["name"] == "wait_rollout"), key=lambda e: e["ts"])
    if len(steps) <= skip or len(rows) <= skip:
        raise SystemExit(f"{run_dir}: needs more than {skip} steps")
    xs = [e for e in spans if e["ts"] >= steps[skip]["ts"]]
    n = len(rows) - skip
    step_s = statistics.fmean(r["time/step"] for r in rows[skip:])
    return {"spans_per_step": len(xs) / n, "step_s": step_s, "steps": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="from_run", default=None, help="a finished run with a timeline")
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ab", type=int, default=0, help="pairs of tiny-cpu runs with the trace on and off")
    ap.add_argument("--task-dir", default=str(REPO / ".cache" / "tiny-task"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res: dict = {"us_per_span": span_cost_us()}
    print(f"cost per span: complete {res['us_per_span']['complete']:.2f} us, span block "
          f"{res['us_per_span']['span']:.2f} us", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="m2po-bench-trace-"))
    run = Path(args.from_run) if args.from_run else None
    if args.ab:
        task = Path(args.task_dir)
        on, off = [], []
        for i in range(args.ab):  # interleaved, so drifts of the machine fall on both arms
            for flag, acc in (("true", on), ("false", off)):
                rows = run_tiny(task, tmp, f"trace-{flag}-{i}", args.steps, 2, [f"logging.trace={flag}"])
                acc.append(statistics.fmean(r["time/step"] for r in rows[args.skip:]))
        res["ab"] = {"on_step_s": on, "off_step_s": off, "ratio": statistics.fmean(on) / statistics.fmean(off)}
        print(f"A/B: step {statistics.fmean(on):.3f} s with the trace, {statistics.fmean(off):.3f} s without "
              f"(ratio {res['ab']['ratio']:.3f}; runs {on} / {off})", flush=True)
        run = run or tmp / "trace-true-0"
    if run is None:
        run_tiny(Path(args.task_dir), tmp, "trace-true-0", args.steps, 2, [])
        run = tmp / "trace-true-0"
    s = spans_per_step(run, args.skip)
    cost = s["spans_per_step"] * res["us_per_span"]["complete"] / 1e6
    res.update(s, overhead_s_per_step=cost, overhead_frac=cost / s["step_s"], run=str(run))
    print(f"{run}: {s['spans_per_step']:.0f} spans per step, step {s['step_s']:.3f} s: tracing costs at most "
          f"{1e3 * cost:.2f} ms per step = {100 * cost / s['step_s']:.2f} % (goal < 2 %)")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
