"""The HF peer of gpu_check (benchmarks/hf_peer.py) traced on fake tensors with m2po rehearse's allocator model:
its peak memory at gpu_check's shapes, before a GPU is rented for it.

    python benchmarks/rehearse_hf_peer.py [--model Qwen__Qwen3-1.7B-Base] [--rows 3] [--row-tokens 16384]
                                          [--recompute full]

Same batch as gpu_check's hf_1p7b part (gpu_parts/rows.py: `rows` packed rows of `row_tokens`, seed 0), bf16
weights, sdpa attention, the peer's fp32 master copies, gradients and AdamW moments. What differs from a GPU:
torch's SDPA with the peer's padding mask runs the CPU's flash kernel here (a GPU takes the memory-efficient
kernel; both keep O(S) per head, not S x S) and AdamW is the single-tensor kernel (a GPU's fused one makes no
temporaries). HF's RMSNorm is the same Python code on both. No CUDA context or fragmentation. Two steps: the
peak is the second's, when AdamW's moments exist (the first step's is printed too). The master gradients are made
inside the step (zeros, freed at its end), so they are counted with the temporaries.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (str(REPO), str(REPO / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen__Qwen3-1.7B-Base")
    ap.add_argument("--rows", type=int, default=3)
    ap.add_argument("--row-tokens", type=int, default=16384)
    ap.add_argument("--recompute", default=None, choices=(None, "full"))
    a = ap.parse_args()

    import torch
    import torch._dynamo

    from gpu_parts import rows as R
    from gpu_parts.common import hf_model, model_config
    from hf_peer import HFPeer
    from m2po_megatron.models.memory import GiB
    from m2po_megatron.infra.fake_world import RehearsalMode

    torch._dynamo.config.disable = True
    cfg = model_config(a.model, smoke=False)
    batch = R.rollout_batch(a.rows, a.row_tokens, cfg["vocab_size"], seed=0)
    mode = RehearsalMode()
    mode.phase = "weights"
    with mode:
        model = hf_model(cfg, "cpu", torch.bfloat16)
    mode.phase = "optimizer"
    # outside the mode: the peer's masks and index tensors are made from the batch, real (their values decide
    # shapes); its master copies and AdamW come from the fake parameters, so they are fake and counted
    peer = HFPeer(model, batch, a.row_tokens, recompute=a.recompute == "full")
    mode.tag(list(model.parameters()), "weights")
    for st in peer.opt.state.values():
        mode.tag(list(st.values()), "optimizer")
    mode.phase = "temporaries"
    with mode, mode.saved_as_activations():
        peer.step()  # the first step makes AdamW's moments
    for st in peer.opt.state.values():
        mode.tag(list(st.values()), "optimizer")
    first = mode.peak
    with mode, mode.saved_as_activations():
        peer.step()  # a steady-state step: the moments exist throughout
    out = {"model": a.model, "rows": a.rows, "row_tokens": a.row_tokens, "tokens": sum(batch.lengths),
           "padded_tokens": peer.padded_tokens, "microbatches": len(peer.groups), "recompute": a.recompute,
           "first_step_peak_gib": round(first / GiB, 1), "peak_gib": round(mode.peak / GiB, 1),
           "peak_phase": mode.peak_phase,
           "at_peak_gib": {k: round(v / GiB, 1) for k, v in mode.breakdown().items()}}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
