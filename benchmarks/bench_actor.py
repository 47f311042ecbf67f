"""Actor throughput on this machine, as ratios to HF transformers in the same run, plus packer padding waste.

CPU: one process (TP1), a tiny Qwen2 (hidden 128, 2 layers, vocab 256), fp32. Reports tokens/s of
compute_log_probs against transformers' padded batch forward, and of train_step against the HF peer doing
the same work on the same batch (benchmarks/hf_peer.py: the M2PO mask's no-grad forward, padded
micro-batches of the same 2048-token budget, forward+backward with the same loss, AdamW).
--attention-backend picks the actor's backend (default: the actor's own default). The GPU numbers come
from benchmarks/gpu_check.py. Usage: python benchmarks/bench_actor.py [--seqs 16] [--reps 3]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "actor"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def padding_report():
    from m2po_megatron.actor.batch import TrainBatch
    from m2po_megatron.actor.packing import padded_batching_waste, padding_waste, plan_microbatches
    import torch

    rng = random.Random(0)
    # Reasoning RL lengths: prompt 50-400 tokens, response lognormal around ~900 capped at 4096.
    lens = [rng.randint(50, 400) + min(4096, int(rng.lognormvariate(6.8, 0.8))) for _ in range(512)]
    b = TrainBatch([torch.zeros(n, dtype=torch.long) for n in lens], [1] * len(lens))
    out = {}
    for budget in (8192, 16384, 32768):
        mbs = plan_microbatches(b, list(range(len(lens))), budget, pad_multiple=8)
        out[budget] = (padding_waste(mbs), padded_batching_waste(lens, budget), len(mbs),
                       -(-sum(lens) // budget))
    return out


def worker(n_seqs, reps, hidden, backend=None):
    import torch

    import actor_workers as w
    from hf_peer import HFPeer
    from m2po_megatron.actor.actor import MegatronActor

    cfg = dict(w.INLINE_QWEN2_UNTIED, hidden_size=hidden, intermediate_size=4 * hidden)
    hf = w.make_hf_model(cfg)
    batch = w.make_batch(n=n_seqs, vocab=cfg["vocab_size"], min_len=64, max_len=256, ref_model=hf)
    hf.set_attn_implementation("sdpa")  # plain HF as users run it (the reference above used eager)
    ntok = sum(batch.lengths)
    kw = {"attention_backend": backend} if backend else {}
    actor = MegatronActor(hf_config=cfg, load_from=hf, micro_batch_tokens=2048, lr=1e-5, loss_name="m2po", **kw)

    def timed(fn):
        fn()  # warm-up
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps

    ids = torch.nn.utils.rnn.pad_sequence(batch.input_ids, batch_first=True)
    am = torch.nn.utils.rnn.pad_sequence([torch.ones_like(x) for x in batch.input_ids], batch_first=True)

    @torch.no_grad()
    def hf_lp():
        logits = hf(ids, attention_mask=am).logits
        return torch.log_softmax(logits.float(), -1)

    peer = HFPeer(hf, batch, 2048, lr=1e-5)

    t_hf_lp = timed(hf_lp)
    t_mg_lp = timed(lambda: actor.compute_log_probs(batch))
    t_hf_tr = timed(peer.step)
    t_mg_tr = timed(lambda: actor.train_step(batch, num_minibatches=1))
    return dict(tokens=ntok, hf_lp=ntok / t_hf_lp, mg_lp=ntok / t_mg_lp, hf_train=ntok / t_hf_tr,
                mg_train=ntok / t_mg_tr, backend=getattr(actor, "attention_backend", "local (before)"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--attention-backend", default=None, help="sdpa | local | te (default: the actor's)")
    a = ap.parse_args()
    from m2po_megatron.actor.launch import run_multiprocess

    print("packer padding waste on 512 RL-like sequences (pad to multiple of 8):")
    for budget, (pw, naive, n, lb) in padding_report().items():
        print(f"  budget {budget:6d}: packed {100 * pw:.2f}% ({n} micro-batches, lower bound {lb}); "
              f"sorted padded batching {100 * naive:.2f}%")
    r = run_multiprocess(worker, 1, args=(a.seqs, a.reps, a.hidden, a.attention_backend), timeout=1200)[0]
    print(f"tiny Qwen2 hidden {a.hidden}, {a.seqs} seqs, {r['tokens']} tokens, CPU fp32, 1 thread, "
          f"attention backend {r['backend']}:")
    print(f"  compute_log_probs: {r['mg_lp']:.0f} tok/s vs HF {r['hf_lp']:.0f} tok/s -> ratio "
          f"{r['mg_lp'] / r['hf_lp']:.2f}")
    print(f"  train_step:        {r['mg_train']:.0f} tok/s vs HF {r['hf_train']:.0f} tok/s -> ratio "
          f"{r['mg_train'] / r['hf_train']:.2f}")


if __name__ == "__main__":
    main()
