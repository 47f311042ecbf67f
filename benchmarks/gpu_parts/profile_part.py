"""Where one step's time goes (issue 51, "profile first"): torch.profiler over one more train_step of a dense part,
after its timed steps, grouped into a table, and its chrome trace (gzipped) for a closer look.

gpu_check --profile DIR has each dense part (qwen3_1p7b, hf_1p7b, qwen3_4b, hf_4b) call `profile_step` once,
in its own warm process, on its own rows. On a GPU the table sums each CUDA kernel's time into one category:
- by where it was launched from (the CPU op's ancestors in the profiler's tree): `log_probs` under the output
  layer's log-prob function (the actor's `output_layer_log_probs`, the HF peer's `lm_head`, their backward
  nodes) and `optimizer` under the optimizer's step (clipping and AdamW; torch's own `Optimizer.step` range);
- else by the kernel's name (KINDS): `attention` (flash, flex, SDPA), `matmul` (cuBLAS/CUTLASS GEMMs), `copies`
  (memcpy, memset), `norms_elementwise` (RMSNorm, SwiGLU, RoPE, residuals, casts: inductor's fused Triton
  kernels and ATen's elementwise and reduction kernels), `other`;
- `host_gaps`: the step's wall time less the time some kernel ran (the union of the kernels' intervals): the
  GPU waiting for the host (launches, Python, syncs).
The heaviest kernels are listed by name with the category each got, so a misfiled kernel shows. Without CUDA
(gpu_check --smoke) the same code sums the CPU ops' self time instead, and host_gaps is None. The trace is
written only when it fits what a device command brings back (MAX_TRACE_BYTES).
"""
from __future__ import annotations

import collections
import contextlib
import gzip
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from gpu_parts.common import sync

CATEGORIES = ("matmul", "attention", "norms_elementwise", "log_probs", "optimizer", "copies", "other", "host_gaps")
LOGPROBS, OPTIMIZER = "m2po::log_probs", "m2po::optimizer"  # the ranges `profile_step`'s wraps add
# launch-site regions: a CPU op under a range (or autograd node) of this name -> its kernels' category
REGIONS = (("log_probs", (LOGPROBS, "FusedLogProbs")), ("optimizer", (OPTIMIZER, "Optimizer.step")))
KINDS = (  # by kernel (or CPU op) name, first match; case-insensitive
    ("optimizer", r"multi_tensor|adam|_foreach_"),
    ("log_probs", r"log_softmax|logsumexp|cross_entropy|nll_loss"),
    ("attention", r"flash|fmha|flex|attention|attn|sdpa|scaled_dot_product"),
    ("matmul", r"gemm|cutlass|nvjet|xmma|cublas|wgmma|triton_tem_fused_(mm|addmm|bmm)|^aten::(mm|addmm|bmm|baddbmm)$"),
    ("attention", r"triton_tem"),  # inductor's other templates here: flex's forward and backward
    ("copies", r"memcpy|memset"),
    ("other", r"nccl"),  # collectives (a one-rank group may still launch them): not elementwise "reduce"s
    ("norms_elementwise", r"norm|elementwise|triton_(poi|red|per)|reduce|vectorized|unrolled|softmax|silu|swiglu|"
                          r"rope|rotary|^aten::"),
)
MAX_TRACE_BYTES = 15 * 1024**2  # a device command brings back files of at most 16 MiB


def kind(name: str) -> str:
    for cat, pat in KINDS:
        if re.search(pat, name, re.I):
            return cat
    return "other"


def _region(ev) -> Optional[str]:
    while ev is not None:
        for cat, marks in REGIONS:
            if any(m in ev.name for m in marks):
                return cat
        ev = ev.cpu_parent
    return None


def _union_us(ranges: Iterable[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for s, e in sorted(ranges):
        if e <= end:
            continue
        busy += e - max(s, end)
        end = e
    return busy


@contextlib.contextmanager
def wrapped(wraps: Iterable[tuple[object, str, str]]):
    """Each (obj, attr, label): obj.attr called inside torch.profiler.record_function(label) while the block
    runs (a module's function, an instance's method or forward); put back after."""
    from torch.profiler import record_function

    undo = []
    for obj, attr, label in wraps:
        orig, own = getattr(obj, attr), attr in vars(obj)

        def call(*a, _orig=orig, _label=label, **kw):
            with record_function(_label):
                return _orig(*a, **kw)

        setattr(obj, attr, call)
        undo.append((obj, attr, orig, own))
    try:
        yield
    finally:
        for obj, attr, orig, own in reversed(undo):
            if own:
                setattr(obj, attr, orig)
            else:
                delattr(obj, attr)


def categorize(events, wall_us: float, on_gpu: bool, top: int = 15) -> dict:
    """The table of one profiled step from the profiler's events (FunctionEvents, CPU tree built)."""
    by_cat: dict = collections.defaultdict(float)
    by_name: dict = collections.defaultdict(float)
    cat_of: dict = {}
    device_ranges = []
    unlinked: dict = collections.defaultdict(float)  # device time by kernel name, less what a CPU op launched

    def add(name: str, cat: str, us: float) -> None:
        by_cat[cat] += us
        by_name[name] += us
        cat_of.setdefault(name, cat)

    for ev in events:
        if not str(ev.device_type).endswith("CPU"):
            device_ranges.append((ev.time_range.start, ev.time_range.end))
            unlinked[ev.name] += ev.time_range.end - ev.time_range.start
            continue
        if on_gpu:
            items = [(k.name, k.duration) for k in ev.kernels]
        else:
            items = [(ev.name, ev.self_cpu_time_total)] if ev.self_cpu_time_total > 0 else []
        if not items:
            continue
        region = _region(ev)
        for name, us in items:
            add(name, region or kind(name), us)
            unlinked[name] -= us
    for name, us in unlinked.items():  # kernels no CPU op claims (launched outside any op): by name alone
        if us > 1e-3:
            add(name, kind(name), us)
    out: dict = {"time": "CUDA kernel time" if on_gpu else "CPU self time (no CUDA)",
                 "wall_ms": round(wall_us / 1e3, 2)}
    if on_gpu:
        busy = _union_us(device_ranges)
        by_cat["host_gaps"] = max(wall_us - busy, 0.0)
        out["gpu_busy_ms"] = round(busy / 1e3, 2)
    out["categories"] = {c: {"ms": round(by_cat.get(c, 0.0) / 1e3, 2),
                             "share_of_wall": round(by_cat.get(c, 0.0) / wall_us, 4) if wall_us else None}
                         for c in CATEGORIES if c != "host_gaps" or on_gpu}
    if not on_gpu:
        out["categories"]["host_gaps"] = None
    out["top"] = [[n[:120], cat_of[n], round(us / 1e3, 2)] for n, us in
                  sorted(by_name.items(), key=lambda x: -x[1])[:top]]
    return out


def write_trace(prof, out_dir: Optional[str], name: str) -> dict:
    """The chrome trace as out_dir/<name>.trace.json.gz, unless it is past MAX_TRACE_BYTES."""
    if not out_dir:
        return {"trace": None}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    dest = Path(out_dir) / f"{name}.trace.json.gz"
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))  # plain JSON, gzipped here: the same on torch 2.11 and 2.14
        with open(raw, "rb") as fin, gzip.open(dest, "wb", compresslevel=6) as fout:
            shutil.copyfileobj(fin, fout)
    size = os.path.getsize(dest)
    if size > MAX_TRACE_BYTES:
        dest.unlink()
        return {"trace": None, "trace_dropped": f"{size / 2**20:.1f} MiB gzipped, past {MAX_TRACE_BYTES >> 20} MiB"}
    return {"trace": str(dest), "trace_mib": round(size / 2**20, 2)}


def profile_step(step: Callable[[], dict], out_dir: Optional[str], name: str,
                 wraps: Iterable[tuple[object, str, str]] = ()) -> tuple[dict, dict]:
    """step() once under torch.profiler (CPU and, when present, CUDA activity; no shapes, stacks or memory, to
    keep its own overhead low). Returns (the table with the trace's path, step()'s result)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with wrapped(wraps):
        sync()
        with profile(activities=acts, record_shapes=False, profile_memory=False, with_stack=False) as prof:
            t0 = time.perf_counter()
            result = step()
            sync()
            wall_us = (time.perf_counter() - t0) * 1e6
    t0 = time.perf_counter()
    table = categorize(prof.events(), wall_us, on_gpu)
    table.update(write_trace(prof, out_dir, name))
    table["analysis_s"] = round(time.perf_counter() - t0, 1)
    return table, result


def profile_in_budget(step, dt: float, deadline: float, out_dir: str, name: str, wraps: list) -> dict:
    """One profiled step (profile_step) when the part's budget leaves room for it, taken as 2 steps (the step
    under the profiler, a little slower) and 10 s (the table and the trace after it)."""
    if time.monotonic() + 2 * dt + 10 > deadline:
        return {"skipped": f"no time left in the part's budget for a profiled step ({dt:.1f} s a step)"}
    table, m = profile_step(step, out_dir, name, wraps)
    table["step_timers_s"] = {k.split("/")[-1]: round(v, 3) for k, v in m.items() if k.startswith("time/actor/")}
    return table


def format_profile(name: str, p: dict) -> str:
    """One line per profiled part for gpu_check's stderr table."""
    if "categories" not in p:
        return f"{name:<16} profile: {p.get('skipped') or p.get('error', '?')}"
    cats = ", ".join(f"{c} {v['share_of_wall']:.0%}" for c, v in p["categories"].items()
                     if v and v["share_of_wall"] is not None and v["ms"] > 0)
    return f"{name:<16} profile ({p['time']}, step {p['wall_ms']:.0f} ms): {cats}"
