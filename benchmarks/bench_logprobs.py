"""The fused output layer + log-probs (actor.fused_logprobs) against today's path (the [S, V] logits ->
actor.logprobs.token_log_probs), forward + backward on one rank, same inputs, interleaved repetitions.

Reports the time ratio (fused / logits path, min over repetitions) and, on CUDA, the allocator's peak above
the inputs for each path. CPU default: fp32, S 2048, H 256, V 8192 (one thread). On a GPU:
python benchmarks/bench_logprobs.py --rows 30000 --hidden 2048 --vocab 151936 --dtype bf16 (Qwen3-1.7B's
output layer at the recipes' rows; today's path needs about 18 GB there).
Usage: python benchmarks/bench_logprobs.py [--rows S] [--hidden H] [--vocab V] [--dtype fp32|bf16] [--reps N]
"""
from __future__ import annotations

import argparse
import time

import torch

from m2po_megatron.actor.fused_logprobs import fused_token_log_probs
from m2po_megatron.actor.logprobs import token_log_probs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)
    dt = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    h0 = torch.randn(a.rows, a.hidden, device=dev, generator=g).to(dt)
    w0 = (torch.randn(a.vocab, a.hidden, device=dev, generator=g) * 0.05).to(dt)
    pos = torch.arange(a.rows, device=dev)
    tgt = torch.randint(0, a.vocab, (a.rows,), device=dev, generator=g)

    def step(fused: bool) -> tuple[float, float]:
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        t = time.perf_counter()
        lp, _ = fused_token_log_probs(h, w, pos, tgt) if fused else token_log_probs(h @ w.t(), pos, tgt)
        lp.sum().backward()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t, (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else 0.0

    times = {True: [], False: []}
    peaks = {}
    for i in range(a.reps + 1):  # the first round warms up
        for fused in (False, True):
            s, peak = step(fused)
            if i:
                times[fused].append(s)
                peaks[fused] = peak
    t_f, t_l = min(times[True]), min(times[False])
    print(f"rows {a.rows}, hidden {a.hidden}, vocab {a.vocab}, {a.dtype}, {dev.type}: forward+backward "
          f"fused {t_f * 1e3:.1f} ms, logits path {t_l * 1e3:.1f} ms -> ratio {t_f / t_l:.2f}")
    if cuda:
        print(f"  peak above the inputs: fused {peaks[True]:.2f} GiB, logits path {peaks[False]:.2f} GiB")


if __name__ == "__main__":
    main()
