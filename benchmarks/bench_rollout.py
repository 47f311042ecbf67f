"""Rollout benchmarks, each a ratio against a baseline measured in the same run on the same machine.

1. CPU server throughput (generated tokens/s) at concurrency 1, 8, 32 / sequential HF `generate` in this
   process (same model, same thread count, sampling on, same max_new_tokens).
2. Weight sync GB/s (DistributedWeightSync over gloo into a running CPU server) / a raw gloo broadcast of
   the same tensors, in the same order, to a helper process (goal >= 0.8).

    python benchmarks/bench_rollout.py [--threads 1] [--max-new-tokens 64] [--out results.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time


def make_model(path: str, vocab: int, hidden: int, layers: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, eos_token_id=1, bos_token_id=0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def hf_baseline(model, prompts, max_new_tokens: int) -> float:
    import torch

    toks, t0 = 0, time.perf_counter()
    for p in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=True, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 top_k=0, top_p=1.0, pad_token_id=0)
        toks += out.shape[1] - len(p)
    return toks / (time.perf_counter() - t0)


async def server_throughput(url: str, prompts, concurrency: int, max_new_tokens: int) -> float:
    from m2po_megatron.rollout.client import RolloutClient

    async with RolloutClient([url], max_concurrency_per_server=concurrency) as c:
        sp = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
        t0 = time.perf_counter()
        res = await asyncio.gather(*(c.generate(prompts[i % len(prompts)], sp) for i in range(concurrency)))
        dt = time.perf_counter() - t0
    return sum(len(r[0].output_ids) for r in res) / dt


def _receiver(port: int, shapes, dtypes, rounds: int):
    import torch
    import torch.distributed as dist

    from m2po_megatron.rollout.process_group import init_custom_process_group

    torch.set_num_threads(1)
    pg = init_custom_process_group(backend="gloo", master_address="127.0.0.1", master_port=port, world_size=2,
                                   rank=1, group_name="raw_bench")
    for _ in range(rounds):
        bufs = [torch.empty(s, dtype=d) for s, d in zip(shapes, dtypes)]
        for w in [dist.broadcast(b, src=0, group=pg, async_op=True) for b in bufs]:
            w.wait()
        dist.barrier(group=pg)


def raw_broadcast_gbps(tensors, rounds: int) -> list[float]:
    import torch.distributed as dist

    from m2po_megatron.rollout.process_group import init_custom_process_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = mp.get_context("spawn").Process(target=_receiver, args=(port, [t.shape for t in tensors],
                                                                   [t.dtype for t in tensors], rounds))
    proc.start()
    pg = init_custom_process_group(backend="gloo", master_address="127.0.0.1", master_port=port, world_size=2,
                                   rank=0, group_name="raw_bench")
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for w in [dist.broadcast(t, src=0, group=pg, async_op=True) for t in tensors]:
            w.wait()
        dist.barrier(group=pg)
        out.append(nbytes / 1e9 / (time.perf_counter() - t0))
    proc.join(60)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the baseline and the server")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--sync-rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    os.environ["M2PO_CPU_SERVER_THREADS"] = str(args.threads)
    from m2po_megatron.rollout.launcher import ServerProcess, ServerSpec
    from m2po_megatron.convert.export import hf_buckets
    from m2po_megatron.rollout.weight_sync import DistributedWeightSync

    tmp = tempfile.mkdtemp(prefix="bench_rollout_")
    model = make_model(os.path.join(tmp, "model"), args.vocab, args.hidden, args.layers)
    prompts = [[(7 * i + j) % (args.vocab - 2) + 2 for j in range(16 + i % 8)] for i in range(32)]
    results: dict = {"threads": args.threads, "max_new_tokens": args.max_new_tokens,
                     "model": {"vocab": args.vocab, "hidden": args.hidden, "layers": args.layers,
                               "params_M": sum(p.numel() for p in model.parameters()) / 1e6}}
    base_before = hf_baseline(model, prompts[:6], args.max_new_tokens)
    server = ServerProcess(ServerSpec(model_path=os.path.join(tmp, "model"), engine="local"),
                           os.path.join(tmp, "server.log"), max_restarts=0, health_timeout_s=300)
    server.start()
    try:
        asyncio.run(server_throughput(server.url, prompts, 2, 4))  # warm-up
        tps_by_c = {c: asyncio.run(server_throughput(server.url, prompts, c, args.max_new_tokens))
                    for c in args.concurrency}
        # The machine is shared: measure the baseline before and after the server runs and use the mean.
        base_after = hf_baseline(model, prompts[:6], args.max_new_tokens)
        base = (base_before + base_after) / 2
        results.update(hf_generate_sequential_tok_s=base, hf_generate_before_after=[base_before, base_after])
        for c, tps in tps_by_c.items():
            results[f"server_c{c}_tok_s"] = tps
            results[f"server_c{c}_ratio_vs_hf"] = tps / base
            print(f"concurrency {c:3d}: {tps:8.1f} tok/s = {tps / base:.2f}x sequential HF generate "
                  f"({base:.1f} tok/s)", flush=True)

        named = [(n, p.detach().clone()) for n, p in model.named_parameters()]
        sync = DistributedWeightSync([server.url], backend="gloo")
        sync.init_group()
        try:
            syncs = [sync.sync(hf_buckets(named, 64 << 20), weight_version=i + 1)["gb_per_s"]
                     for i in range(args.sync_rounds)]
        finally:
            sync.close()
        raw = raw_broadcast_gbps([t for _, t in named], args.sync_rounds)
        results.update(sync_gb_s=statistics.median(syncs), raw_broadcast_gb_s=statistics.median(raw),
                       sync_ratio_vs_raw=statistics.median(syncs) / statistics.median(raw),
                       sync_bytes=sum(t.numel() * t.element_size() for _, t in named))
        print(f"weight sync: {results['sync_gb_s']:.3f} GB/s = {results['sync_ratio_vs_raw']:.2f}x raw gloo "
              f"broadcast ({results['raw_broadcast_gb_s']:.3f} GB/s) of {results['sync_bytes'] / 1e6:.1f} MB",
              flush=True)
    finally:
        server.stop()
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
