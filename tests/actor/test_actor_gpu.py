"""GPU checks (skipped without CUDA): bf16 step with the TE spec, FP8 forward+backward, tokens/s and MFU."""
import time

import pytest

import actor_workers as w
from m2po_megatron.actor.launch import run_multiprocess


def _gpu_worker(fp8):
    import torch

    from m2po_megatron.actor.actor import MegatronActor

    cfg = dict(w.INLINE_QWEN2_UNTIED, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
               num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)
    hf = w.make_hf_model(cfg)
    batch = w.make_batch(n=32, vocab=cfg["vocab_size"], min_len=256, max_len=1024, ref_model=hf)
    actor = MegatronActor(hf_config=cfg, load_from=hf, precision="bf16", fp8=fp8,
                          fp8_recipe="tensorwise" if fp8 else None, micro_batch_tokens=8192, lr=1e-5)
    m = actor.train_step(batch)
    torch.cuda.synchronize()
    t = time.perf_counter()
    m = actor.train_step(batch)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    ntok = sum(batch.lengths)
    params = sum(p.numel() for p in hf.parameters())
    flops = 3 * 2 * params * ntok * 2  # fwd+bwd (3x) of 2*N flops/token; x2: the no-grad mask forward ~ +1/3
    peak = 989e12  # H100/H200 dense bf16
    print(f"fp8={fp8}: {ntok / dt:.0f} tok/s, MFU ~{flops / dt / peak:.3f}, loss {m['loss']:.4f}")
    return m


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fp8", [None, "e4m3"])
def test_bf16_and_fp8_train_step_on_gpu(fp8):
    m = run_multiprocess(_gpu_worker, 1, args=(fp8,), timeout=580)[0]
    assert m["num_updates"] == 1 and m["grad_norm"] == m["grad_norm"]
