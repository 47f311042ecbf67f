"""Benchmark of m2po_keep_mask (not a test): time as a ratio to one torch.sort of the same tensor in the
same run, speed-up over a literal greedy loop, and peak extra memory.

    .venv/bin/python benchmarks/bench_m2po_mask.py [--sizes 1e5 1e6 1e7] [--device cpu|cuda] [--reps 5]

Data: float32 log-ratios with heavy tails (Student-t, 3 dof, scale 0.13, so M2 over T is ~0.05 > tau), advantages +-1 per token, 90% of
tokens valid, tau = 0.04. The literal loop (Algorithm 1 as written: recompute the mean of the remaining T,
drop its argmax, repeat; one host sync per dropped token) is run on the sizes given by --loop-sizes only;
its cost is O(n * drops) = O(n^2) for a fixed dropped fraction, so larger sizes are extrapolated
quadratically from the largest measured one (printed as such).
Peak memory: on CUDA torch.cuda.max_memory_allocated over the call; on CPU the growth of the process's
peak RSS (VmHWM, reset through /proc/self/clear_refs) during one call, in a fresh subprocess per size
(inputs allocated before).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from m2po_megatron.algo import m2po_keep_mask
from m2po_megatron.algo.mask import trust_region

TAU = 0.04


def make(n: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # StudentT samples from the global generator
    lr = (torch.distributions.StudentT(torch.tensor(3.0)).sample((n,)) * 0.13).float()
    adv = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    mask = torch.rand(n, generator=g) < 0.9
    return lr.to(device), adv.to(device), mask.to(device)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timeit(fn, device, reps):
    fn()  # warm-up
    sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def literal_greedy(lr, adv, mask, tau):
    """Algorithm 1 written as a loop (what the released code's per-token loop costs, order of magnitude)."""
    tr = trust_region(lr, adv, mask)
    v = torch.where(tr, lr.double().square(), torch.zeros((), dtype=torch.float64, device=lr.device))
    remaining = tr.clone()
    count = int(remaining.sum())
    total = float(v.sum())
    while count and total > tau * count:
        i = int(torch.argmax(torch.where(remaining, v, -1.0)))
        remaining[i] = False
        total -= float(v[i])
        count -= 1
    return mask & ~(tr & ~remaining)


def _proc_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_memory_child(n: int, device: str, what: str) -> int:
    small = make(1000, device)  # warm-up: load code pages and allocator state before measuring
    m2po_keep_mask(*small, tau=TAU) if what == "mask" else torch.sort(small[0])
    lr, adv, mask = make(n, device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:  # Linux: reset the peak RSS (VmHWM) to the current RSS
            f.write("5")
        base = _proc_kib("VmRSS") * 1024
    if what == "mask":
        m2po_keep_mask(lr, adv, mask, tau=TAU)
    else:
        torch.sort(lr)
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return _proc_kib("VmHWM") * 1024 - base


def peak_memory(n: int, device: str, what: str) -> int:
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"import bench_m2po_mask as b, torch; torch.set_num_threads({torch.get_num_threads()}); "
            f"print(b.peak_memory_child({n}, {device!r}, {what!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", type=float, default=[1e5, 1e6, 1e7])
    p.add_argument("--loop-sizes", nargs="+", type=float, default=[1e4, 1e5])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="also write the results to this file")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"device={a.device} threads={a.threads} torch={torch.__version__} load={os.getloadavg()[0]:.1f}")

    loop = {}
    for n in map(int, a.loop_sizes):
        lr, adv, mask = make(n, a.device)
        t0 = time.perf_counter()
        ref = literal_greedy(lr, adv, mask, TAU)
        loop[n] = time.perf_counter() - t0
        assert torch.equal(ref, m2po_keep_mask(lr, adv, mask, tau=TAU)), "vectorised mask != literal loop"
        print(f"literal loop n={n:.0e}: {loop[n]:.3f} s, dropped {int((mask & ~ref).sum())} tokens (masks equal)")
    n_loop = max(loop)

    rows = []
    for n in map(int, a.sizes):
        lr, adv, mask = make(n, a.device)
        t_mask = timeit(lambda: m2po_keep_mask(lr, adv, mask, tau=TAU), a.device, a.reps)
        t_sort = timeit(lambda: torch.sort(lr), a.device, a.reps)
        kept = m2po_keep_mask(lr, adv, mask, tau=TAU)
        dropped = int((mask & ~kept).sum())
        if n in loop:
            t_loop, how = loop[n], "measured"
        else:
            t_loop, how = loop[n_loop] * (n / n_loop) ** 2, f"extrapolated ~n^2 from {n_loop:.0e}"
        mem_mask = peak_memory(n, a.device, "mask")
        mem_sort = peak_memory(n, a.device, "sort")
        row = dict(n=n, mask_s=t_mask, sort_s=t_sort, ratio_to_sort=t_mask / t_sort, dropped=dropped,
                   loop_s=t_loop, loop_how=how, speedup_vs_loop=t_loop / t_mask,
                   peak_mask_mb=mem_mask / 2**20, peak_sort_mb=mem_sort / 2**20)
        rows.append(row)
        print(f"n={n:.0e}: mask {t_mask * 1e3:.1f} ms, sort {t_sort * 1e3:.1f} ms, ratio {row['ratio_to_sort']:.2f}x; "
              f"dropped {dropped} ({dropped / int(mask.sum()):.3%} of valid); literal loop {t_loop:.3g} s ({how}), "
              f"speed-up {row['speedup_vs_loop']:.3g}x; peak extra memory mask {row['peak_mask_mb']:.1f} MiB, "
              f"sort {row['peak_sort_mb']:.1f} MiB")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=a.device, threads=a.threads, loop=loop, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
