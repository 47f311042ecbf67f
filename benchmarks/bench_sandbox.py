#!/usr/bin/env python
"""Cost of the code reward's bubblewrap sandbox, with baselines from the same run.

    .venv/bin/python benchmarks/bench_sandbox.py [--reps 40] [--items 48] [--out FILE]

(1) Per-execution overhead of a trivial program (`print(1)`): a plain `python -I` subprocess (the baseline),
    the unsandboxed runner (the same launcher, rlimits and output handling, no bwrap) and the sandbox,
    interleaved repetition by repetition; medians in milliseconds, overhead = sandbox - plain.
(2) Throughput of the `code` reward (samples/s, one process, serial): a mix of correct, wrong and crashing
    stdin/stdout programs (3 cases each; default all-or-nothing scoring stops at the first failing case)
    scored sandboxed and unsandboxed (allow_unsandboxed with M2PO_BWRAP pointing at /bin/false), alternating
    sample by sample; ratio = sandboxed / unsandboxed.
Markdown tables on stdout, the numbers as JSON on stderr (and in --out).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date


def overhead(reps: int) -> dict:
    from m2po_megatron.sandbox import Limits, run_sandboxed, run_unsandboxed
    from m2po_megatron.sandbox.process import interpreter

    exe, files, lim = interpreter(), {"main.py": b"print(1)\n"}, Limits(timeout_s=30)

    def plain():
        subprocess.run([exe, "-I", "-c", "print(1)"], capture_output=True, check=True, env={})

    def unsandboxed():
        assert run_unsandboxed(files, "main.py", b"", lim).stdout == b"1\n"

    def sandboxed():
        assert run_sandboxed(files, "main.py", b"", lim).stdout == b"1\n"

    modes = {"plain python -I subprocess": plain, "unsandboxed runner": unsandboxed, "bwrap sandbox": sandboxed}
    for fn in modes.values():  # warm-up: the sandbox probe, the page cache
        fn()
    times: dict[str, list[float]] = {k: [] for k in modes}
    for i in range(reps):
        order = list(modes.items())
        for name, fn in order if i % 2 == 0 else reversed(order):
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1000)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["plain python -I subprocess"]
    return {"reps": reps, "median_ms": {k: round(v, 1) for k, v in med.items()},
            "vs_plain": {k: round(v / base, 2) for k, v in med.items()},
            "sandbox_overhead_ms": round(med["bwrap sandbox"] - base, 1)}


def make_items(n: int) -> list[tuple[str, dict]]:
    tests = [{"input": f"{a} {b}\n", "output": f"{a + b}\n"} for a, b in ((1, 2), (40, 2), (-7, 7))]
    programs = [
        "a, b = map(int, input().split())\nprint(a + b)",  # correct: all 3 cases run
        "a, b = map(int, input().split())\nprint(a * b)",  # wrong at the first case
        "import sys\nnums = [int(x) for x in sys.stdin.read().split()]\nprint(sum(nums))",  # correct
        "a, b = input().split()\nprint(a + b)",  # string concatenation: wrong
        "print(undefined_name)",  # runtime error
    ]
    return [(f"```python\n{programs[i % len(programs)]}\n```", {"tests": tests}) for i in range(n)]


def throughput(n: int, bwrap: str) -> dict:
    from m2po_megatron.reward.code import code_reward

    items = make_items(n)
    spent = {"sandboxed": 0.0, "unsandboxed": 0.0}
    scores: dict[str, list[float]] = {"sandboxed": [], "unsandboxed": []}

    def one(mode: str, response: str, row: dict) -> None:
        os.environ["M2PO_BWRAP"] = bwrap if mode == "sandboxed" else "/bin/false"
        t = time.perf_counter()
        out = code_reward(response, [], row, allow_unsandboxed=(mode == "unsandboxed"))
        spent[mode] += time.perf_counter() - t
        scores[mode].append(out["score"])

    one("sandboxed", *items[0])  # warm-up (probes) out of the timing
    one("unsandboxed", *items[0])
    spent = {k: 0.0 for k in spent}
    scores = {k: [] for k in scores}
    for i, (response, row) in enumerate(items):
        for mode in (("sandboxed", "unsandboxed") if i % 2 == 0 else ("unsandboxed", "sandboxed")):
            one(mode, response, row)
    if scores["sandboxed"] != scores["unsandboxed"]:
        raise SystemExit("the sandboxed and unsandboxed code rewards disagree")
    rate = {k: n / v for k, v in spent.items()}
    return {"items": n, "samples_per_s": {k: round(v, 1) for k, v in rate.items()},
            "sandboxed_vs_unsandboxed": round(rate["sandboxed"] / rate["unsandboxed"], 2),
            "mean_score": round(statistics.mean(scores["sandboxed"]), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--items", type=int, default=48)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    from m2po_megatron.sandbox import find_bwrap, sandbox_status

    st = sandbox_status()
    if not st.ok:
        raise SystemExit(f"no working sandbox: {st.detail}")
    bwrap = find_bwrap()
    ov = overhead(args.reps)
    tp = throughput(args.items, bwrap)
    print(f"| one run of print(1) ({ov['reps']} interleaved reps) | median ms | vs plain |\n|---|---|---|")
    for k, v in ov["median_ms"].items():
        print(f"| {k} | {v} | {ov['vs_plain'][k]}x |")
    print(f"\nsandbox overhead per execution: {ov['sandbox_overhead_ms']} ms\n")
    print(f"| code reward, {tp['items']} samples x 3 cases, serial | samples/s |\n|---|---|")
    for k, v in tp["samples_per_s"].items():
        print(f"| {k} | {v} |")
    print(f"\nsandboxed / unsandboxed throughput: {tp['sandboxed_vs_unsandboxed']}x")
    res = {"overhead": ov, "code_reward": tp, "date": date.today().isoformat(), "cpus": os.cpu_count(),
           "loadavg": [round(x, 2) for x in os.getloadavg()], "kernel": platform.release(),
           "python": platform.python_version(), "uid": os.geteuid()}
    print(json.dumps(res, indent=1), file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
