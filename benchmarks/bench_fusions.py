"""What megatron's two torch.compile fusions cost and gain on this machine, as ratios to the unfused path in the
same run (models/builder.py sets bias_activation_fusion / bias_dropout_fusion from this; docs/models.md).

With add_bias_linear=False and dropout 0 (every supported model) the fusions reduce to:
- bias_activation_fusion: megatron's MLP calls `bias_swiglu_impl(x, None)` = `SwiGLUFunction`, an autograd
  Function that saves only its input and recomputes in backward, whose `swiglu` (forward) and `swiglu_back`
  (backward) are wrapped by `megatron.core.jit.jit_fuser` = torch.compile. Unfused: `silu(x1) * x2` in eager.
  Measured three ways: "unfused" (megatron's else branch), "function" (SwiGLUFunction with torch.compile
  forced eager: the memory saving without the compile), "compiled" (megatron as shipped).
- bias_dropout_fusion: `bias_dropout_add_fused_train((x, None), residual, 0.0)`: dropout(p=0) + residual,
  compiled; unfused: the same function in eager (dropout with p=0 returns its input: one add either way).

Reported per row length (tokens of a packed row, in order, so later lengths show the recompiles): time of the
first forward+backward (the compile, when there is one), the number of graphs dynamo compiled for it
(torch._dynamo counters), the steady-state forward+backward time (the fastest of --reps) as a ratio to unfused, and the bytes per token
autograd keeps for backward. The inductor cache goes to a fresh directory (a cold compile, as in a new
process on a new machine) unless --warm-cache. CPU only here; on a GPU the same script runs the CUDA path.
Usage: python benchmarks/bench_fusions.py [--ffn 1536] [--hidden 512] [--rows 1024,2048,4096,8192] [--reps 10]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


EAGER = {"function"}  # variants run with torch.compile forced eager


def _saved_bytes(fn) -> int:
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def _time(fn, reps: int) -> float:
    """The fastest of `reps` runs: on a shared, loaded CPU the minimum is the least noisy estimate."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def run(ffn: int, hidden: int, rows: list[int], reps: int, dtype_name: str, device: str) -> dict:
    import torch
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused_train, bias_dropout_add_unfused
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def unfused_swiglu(x):  # megatron MLP's glu() with bias_activation_fusion=False (glu_linear_offset 0.0)
        a, b = torch.chunk(x, 2, dim=-1)
        return F.silu(a) * (b + 0.0)

    def fused_swiglu(x):
        return bias_swiglu_impl(x, None)

    function_eager = fused_swiglu  # run with torch.compile forced eager, forward and backward (EAGER below)

    unfused_bda = bias_dropout_add_unfused(True)

    def bda_unfused(x, r):
        return unfused_bda((x, None), r, 0.0)

    def bda_fused(x, r):
        return bias_dropout_add_fused_train((x, None), r, 0.0)

    cases = {
        "swiglu": ({"unfused": unfused_swiglu, "function": function_eager, "compiled": fused_swiglu},
                   lambda s: (torch.randn(s, 2 * ffn, device=device, dtype=dtype, requires_grad=True),)),
        "bias_dropout_add": ({"unfused": bda_unfused, "compiled": bda_fused},
                             lambda s: (torch.randn(s, hidden, device=device, dtype=dtype, requires_grad=True),
                                        torch.randn(s, hidden, device=device, dtype=dtype, requires_grad=True))),
    }
    out: dict = {}
    for name, (variants, make) in cases.items():
        res = {v: [] for v in variants}
        for s in rows:
            args = make(s)
            g = torch.randn_like(variants["unfused"](*args))

            for v, fn in variants.items():
                def step(fn=fn, v=v):
                    with torch.compiler.set_stance("force_eager" if v in EAGER else "default"):
                        y = fn(*args)
                        y.backward(g)
                    sync()

                graphs0 = counters["stats"]["unique_graphs"]
                t0 = time.perf_counter()
                step()
                first = time.perf_counter() - t0
                compiled = counters["stats"]["unique_graphs"] - graphs0
                steady = _time(step, reps)
                with torch.compiler.set_stance("force_eager" if v in EAGER else "default"):
                    nbytes = _saved_bytes(lambda fn=fn: fn(*args))
                res[v].append({"row": s, "first_s": round(first, 4), "graphs_compiled": compiled,
                               "steady_s": steady, "saved_bytes_per_token": nbytes / s})
        for v in variants:
            for r, base in zip(res[v], res["unfused"]):
                r["steady_ratio_to_unfused"] = round(r["steady_s"] / base["steady_s"], 3)
                r["steady_s"] = round(r["steady_s"], 5)
        out[name] = res
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ffn", type=int, default=1536, help="ffn size on one TP rank (SwiGLU input is 2 x ffn)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--rows", default="1024,2048,4096,8192", help="row lengths in tokens, in the order run")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--warm-cache", action="store_true", help="use the inductor cache as it is")
    ap.add_argument("--json", action="store_true", help="print the raw results as JSON")
    a = ap.parse_args(argv)
    if not a.warm_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_fusions_")
    import torch

    torch.set_num_threads(int(os.environ.get("M2PO_BENCH_THREADS", "1")))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    res = run(a.ffn, a.hidden, [int(x) for x in a.rows.split(",")], a.reps, a.dtype, device)
    if a.json:
        print(json.dumps(res, indent=1))
    print(f"device={device} dtype={a.dtype} ffn={a.ffn} hidden={a.hidden} threads={torch.get_num_threads()} "
          f"torch={torch.__version__} total={time.perf_counter() - t0:.1f}s")
    for name, variants in res.items():
        print(f"\n{name}: row  variant   first_s  graphs  steady_ratio  saved_B/token")
        for v, rows in variants.items():
            for r in rows:
                print(f"  {r['row']:>6}  {v:<9} {r['first_s']:>8.3f}  {r['graphs_compiled']:>6}  "
                      f"{r['steady_ratio_to_unfused']:>12.3f}  {r['saved_bytes_per_token']:>12.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
