"""plan/costs.py against hand-computed figures, one test per modelling choice (docs/plan.md, "Cost models and
their sources"), and the decode roofline's closed forms against brute-force sums."""
import dataclasses
import random

import pytest

from m2po_megatron.models.memory import ModelShape, model_shape, param_count
from m2po_megatron.plan.costs import (Costs, Layout, attention_flops, from_hardware, kv_bytes_per_gpu,
                                      matmul_params)
from m2po_megatron.plan.hardware import GPUS

CFG = "m2po_megatron/assets/configs/{}/config.json"
Q8 = model_shape(CFG.format("Qwen__Qwen3-8B-Base"))  # untied
N8 = param_count(CFG.format("Qwen__Qwen3-8B-Base"))
Q4 = model_shape(CFG.format("Qwen__Qwen3-4B-Base"))  # tied; hidden 2560, 32 heads x 128
N4 = param_count(CFG.format("Qwen__Qwen3-4B-Base"))
# Qwen2.5-1.5B's shape: 2 KV heads, so a server of TP 4 replicates them
Q15 = ModelShape(hidden=1536, layers=28, heads=12, kv_heads=2, head_dim=128, ffn=8960, vocab=151936, tied=True,
                 qkv_bias=True, qk_norm=False)
PEAK, HBM = 989e12, 3.35e12  # H100 BF16 dense, HBM3
EFF = {"mfu": 0.35, "hbm": 0.7, "decode_compute": 0.5, "prefill": 0.5, "link": 0.5}


def costs(shape=Q8, params=N8, lay=Layout(1, 1, 1, 1, 1), gpu="h100", ctx=0.0, **kw):
    return from_hardware(shape, params, lay, gpu, micro_batches=1, mean_context=ctx, **kw)


# ------------------------------------------------------------------------------------------ 1. NVLink

def test_nvlink_is_per_direction_and_carries_a_same_node_sync():
    assert (GPUS["h100"].nvlink_gb_s, GPUS["h200"].nvlink_gb_s, GPUS["a100"].nvlink_gb_s) == (450, 450, 300)
    w = 2 * N8  # every weight, bf16
    near, far = costs(same_node_sync=True), costs(same_node_sync=False)
    assert near.weight_bytes == w
    assert near.sync_s() == pytest.approx(2.0 + w / (450e9 * EFF["link"]), rel=1e-12)  # 2.0728 s, not 2.036
    assert far.sync_s() == pytest.approx(2.0 + w / (50e9 * EFF["link"]), rel=1e-12)
    assert costs(gpu="a100", same_node_sync=True).sync_per_byte_s == pytest.approx(1 / (300e9 * EFF["link"]))


# ------------------------------------------------------------------------------------------ 2. N without the input embedding

def test_flops_count_matmul_parameters_tied_and_untied():
    assert matmul_params(Q8, N8) == N8 - 151936 * 4096 == 7_568_405_504  # untied: the lookup is not a matmul
    assert matmul_params(Q4, N4) == N4 == 4_022_468_096  # tied: the one table is the output projection
    for shape, n, n_mm in ((Q8, N8, 7_568_405_504), (Q4, N4, 4_022_468_096)):
        c = costs(shape, n)
        assert c.train_per_token_s == pytest.approx(6 * n_mm / (PEAK * EFF["mfu"]), rel=1e-12)
        assert c.logprob_per_token_s == pytest.approx(c.train_per_token_s / 3)
        assert c.decode_per_seq_s == pytest.approx(2 * n_mm / (PEAK * EFF["decode_compute"]), rel=1e-12)
        assert c.prefill_per_token_s == pytest.approx(2 * n_mm / (PEAK * EFF["prefill"]), rel=1e-12)
        assert c.weight_bytes == 2 * n  # the sync still sends every weight


# ------------------------------------------------------------------------------------------ 3. attention

def test_attention_flops_use_heads_times_head_dim():
    assert attention_flops(Q4, 1000) == 12 * 36 * 4096 * 1000 / 2 == 884_736_000  # 32 x 128, not hidden 2560
    lay = Layout(2, 1, 4, 1, 1)
    extra = costs(Q4, N4, lay, ctx=1000).train_per_token_s - costs(Q4, N4, lay, ctx=0).train_per_token_s
    assert extra == pytest.approx(884_736_000 / (8 * PEAK * EFF["mfu"]), rel=1e-9)


# ------------------------------------------------------------------------------------------ 4. the roofline

def test_decode_is_the_larger_of_compute_and_memory():
    c = costs()
    n_mm = 7_568_405_504
    weights_s = 2 * n_mm / (HBM * EFF["hbm"])  # 6.45 ms: the matmul weights, read once per step
    per_seq = 2 * n_mm / (PEAK * EFF["decode_compute"])  # 30.6 us
    assert c.decode_roofline and c.decode_weights_s == pytest.approx(weights_s, rel=1e-12)
    assert c.decode_fixed_s == pytest.approx(0.002)  # scheduling only: TP 1 has no all-reduce
    assert weights_s / per_seq == pytest.approx(210.9, abs=0.1)  # the ridge: batch ~211 at no KV
    # memory-bound: the batch is free until the ridge
    for b in (1, 64, 128, 210):
        assert c.decode_step_s(b, 0) == pytest.approx(0.002 + weights_s, rel=1e-12)
    # compute-bound past it: linear in the batch
    for b in (212, 512, 1024):
        assert c.decode_step_s(b, 0) == pytest.approx(0.002 + b * per_seq, rel=1e-12)
    # KV moves it back: 512 sequences of 1000 tokens read 512k x 147 kB = 75.5 GB, 32 ms > 15.7 ms of compute
    kv = 512 * 1000
    assert c.decode_step_s(512, kv) == pytest.approx(0.002 + weights_s + kv * 147456 / (HBM * EFF["hbm"]), rel=1e-12)
    # the sum form of the same terms, as before the roofline, is strictly more
    s = dataclasses.replace(c, decode_roofline=False)
    assert s.decode_step_s(512, 0) == pytest.approx(0.002 + weights_s + 512 * per_seq, rel=1e-12)


def test_tp_all_reduces_do_not_overlap():
    c = costs(lay=Layout(1, 1, 1, 4, 1))
    assert c.decode_fixed_s == pytest.approx(0.002 + 2 * 36 * 15e-6)
    assert c.decode_weights_s == pytest.approx(2 * 7_568_405_504 / 4 / (HBM * EFF["hbm"]))


def brute(c: Costs, k: int, b: int, kv0: float) -> float:
    return sum(c.decode_step_s(b, kv0 + i * b) for i in range(k))


ROOF = Costs(train_fixed_s=0, train_per_update_s=0, train_per_token_s=0, logprob_per_token_s=0,
             decode_fixed_s=0.002, decode_per_seq_s=3e-5, decode_per_kv_s=6e-8, prefill_per_token_s=0,
             max_running=1024, sync_fixed_s=0, sync_per_byte_s=0, weight_bytes=0, decode_weights_s=0.0065,
             decode_roofline=True)
SUM = dataclasses.replace(ROOF, decode_roofline=False)


@pytest.mark.parametrize("c", [ROOF, SUM], ids=["roofline", "sum"])
def test_decode_series_matches_the_step_by_step_sum_and_inverts(c):
    rng = random.Random(0)
    # the compute-bound prefix and the crossing: batch 300 at no KV is compute-bound for 145 steps
    assert c.decode_s(300, 300, 0) == pytest.approx(brute(c, 300, 300, 0), rel=1e-12)
    for _ in range(300):
        b, kv0, k = rng.choice([1, 7, 100, 216, 300, 1024]), rng.choice([0, 50, 5000, 2e5]), rng.randint(0, 400)
        t = c.decode_s(k, b, kv0)
        assert t == pytest.approx(brute(c, k, b, kv0), rel=1e-11, abs=1e-15)
        assert c.steps_within(t, b, kv0) == k  # exactly at the boundary, despite round-off
        if k:
            assert c.steps_within(t * (1 - 1e-6), b, kv0) == k - 1


def test_decode_lb_bounds_every_schedule_and_is_exact_in_the_sum_form():
    rng = random.Random(1)
    for _ in range(500):
        steps, b, kv0 = rng.randint(1, 600), rng.randint(1, 1024), rng.uniform(0, 3e5)
        tokens, kv_sum = steps * b, steps * kv0 + b * steps * (steps - 1) / 2
        assert ROOF.decode_lb(tokens, kv_sum, steps) <= ROOF.decode_s(steps, b, kv0) * (1 + 1e-12)
        assert SUM.decode_lb(tokens, kv_sum, steps) == pytest.approx(SUM.decode_s(steps, b, kv0), rel=1e-12)
    # a schedule that mixes batches: the bound holds for the sum of its two phases
    t = ROOF.decode_s(100, 20, 0) + ROOF.decode_s(100, 900, 2000)
    kv_sum = 20 * 100 * 99 / 2 + 100 * 2000 + 900 * 100 * 99 / 2
    assert ROOF.decode_lb(100 * 20 + 100 * 900, kv_sum, 200) <= t


def test_a_calibrated_sum_form_is_unchanged_by_the_new_fields():
    old = dict(decode_fixed_s=0.01, decode_per_seq_s=1e-4, decode_per_kv_s=1e-7)
    c = Costs(train_fixed_s=0, train_per_update_s=0, train_per_token_s=0, logprob_per_token_s=0,
              prefill_per_token_s=0, max_running=8, sync_fixed_s=0, sync_per_byte_s=0, weight_bytes=0, **old)
    assert not c.decode_roofline and c.decode_weights_s == 0
    steps, b, kv0 = 50, 12, 300
    assert c.decode_s(steps, b, kv0) == pytest.approx(
        steps * (0.01 + b * 1e-4) + (steps * kv0 + b * steps * (steps - 1) / 2) * 1e-7, rel=1e-14)


# ------------------------------------------------------------------------------------------ 5. the KV budget

def test_kv_bytes_per_gpu_and_the_pool_after_weights():
    assert kv_bytes_per_gpu(Q8, 1) == 2 * 36 * 8 * 128 * 2 == 147456
    assert kv_bytes_per_gpu(Q8, 8) == 18432
    # 2 KV heads: a server of TP 4 holds one whole head per GPU, as TP 2 does (replicated, not halved)
    assert kv_bytes_per_gpu(Q15, 2) == kv_bytes_per_gpu(Q15, 4) == 2 * 28 * 1 * 128 * 2 == 14336
    n15 = 1_543_714_304  # its parameter count (tied), as param_count gives for this shape
    c2, c4 = (costs(Q15, n15, Layout(1, 1, 1, t, 1), ctx=1000) for t in (2, 4))
    assert c2.decode_per_kv_s == c4.decode_per_kv_s == pytest.approx(14336 / (HBM * EFF["hbm"]))
    pool = lambda t: 80e9 * 0.85 - 2 * n15 / t  # noqa: E731 per GPU: SGLang's static fraction less the weights
    assert c4.max_running == 1024  # the cap: (68 GB - 0.77 GB) / 14336 B / 1000 = 4689
    assert costs(Q15, n15, Layout(1, 1, 1, 4, 1), ctx=10_000).max_running == int(pool(4) / 14336 / 10_000)
    # Qwen3-8B: (68 GB - 16.4 GB) / 147456 B / 1000 = 350 at TP 1, and (68 - 8.2) / 73728 / 1000 = 811 at TP 2
    assert costs(ctx=1000).max_running == int((68e9 - 2 * N8) / 147456 / 1000) == 350
    assert costs(lay=Layout(1, 1, 1, 2, 1), ctx=1000).max_running == int((68e9 - N8) / 73728 / 1000) == 811
    assert costs(ctx=1000, mem_fraction_static=0.2).max_running == 1  # weights over the static fraction


# ------------------------------------------------------------------------------------------ 6. FP8

def test_fp8_runs_the_decoder_layers_matmuls_at_the_fp8_peak():
    assert GPUS["h100"].fp8_tflops == GPUS["h200"].fp8_tflops == 1979 and GPUS["a100"].fp8_tflops is None
    lay = Layout(2, 1, 4, 1, 1)
    bf16, fp8 = costs(lay=lay, ctx=2000), costs(lay=lay, ctx=2000, fp8=True)
    layers_mm = 7_568_405_504 - 151936 * 4096  # the output layer and attention stay BF16
    saved = 6 * layers_mm * (1 / PEAK - 1 / 1979e12) / (8 * EFF["mfu"])
    assert bf16.train_per_token_s - fp8.train_per_token_s == pytest.approx(saved, rel=1e-9)
    # per token, in BF16-equivalent parameters: layers 6.95 G at half cost, output layer 0.62 G and attention
    # at 2000 tokens of context 0.29 G at full: 4.39 of 7.86, not a half (at TP 1: no TP traffic beside it)
    tp1 = Layout(1, 1, 8, 1, 1)
    ratio = costs(lay=tp1, ctx=2000, fp8=True).train_per_token_s / costs(lay=tp1, ctx=2000).train_per_token_s
    assert ratio == pytest.approx(0.558, abs=0.001)
    assert fp8.decode_per_seq_s == bf16.decode_per_seq_s  # the servers decode in BF16 either way
    with pytest.raises(ValueError, match="model.fp8"):
        costs(gpu="a100", fp8=True)


# ------------------------------------------------------------------------------------------ 7. the DP reduce

def test_data_parallel_gradient_reduce():
    opt = 32 * N8 / (HBM * EFF["hbm"])  # the optimizer's traffic over all its shards
    assert costs(lay=Layout(2, 1, 1, 1, 1)).train_per_update_s == pytest.approx(opt / 2, rel=1e-12)  # dp 1: none
    # TP 2 x DP 4 on one node: reduce-scatter fp32 grads and all-gather bf16 params over NVLink, per direction
    rank = N8 / 2
    nvl = 3 / 4 * rank * (4 + 2) / (450e9 * EFF["link"])
    assert costs(lay=Layout(2, 1, 4, 1, 1)).train_per_update_s == pytest.approx(opt / 8 + nvl, rel=1e-12)
    # DP 8 spans two nodes: the rank's own NIC
    ib = 7 / 8 * rank * 6 / (50e9 * EFF["link"])
    assert costs(lay=Layout(2, 1, 8, 1, 1)).train_per_update_s == pytest.approx(opt / 16 + ib, rel=1e-12)
    assert costs(lay=Layout(2, 1, 4, 1, 1), gpus_per_node=4).train_per_update_s == pytest.approx(
        opt / 8 + 3 / 4 * rank * 6 / (50e9 * EFF["link"]), rel=1e-12)
    # without the distributed optimizer: an all-reduce of the grads, and every rank steps its whole shard
    ar = 2 * 3 / 4 * rank * 4 / (450e9 * EFF["link"])
    assert costs(lay=Layout(2, 1, 4, 1, 1), use_distributed_optimizer=False).train_per_update_s == pytest.approx(
        opt / 2 + ar, rel=1e-12)
    # gradients reduced in bf16 (grad_reduce_in_fp32=False) move half the gradient bytes
    half = 3 / 4 * rank * (2 + 2) / (450e9 * EFF["link"])
    assert costs(lay=Layout(2, 1, 4, 1, 1), grad_bytes=2).train_per_update_s == pytest.approx(opt / 8 + half)


# ------------------------------------------------------------------------------------------ tensor-parallel traffic

def test_training_pays_tensor_parallel_traffic_per_token():
    """8 collectives per layer (around attention and the MLP, forward and backward), (TP - 1) / TP of hidden x 2
    bytes each per rank, over NVLink per direction at the link efficiency, per stage of layers / PP, for the
    1 / DP of the tokens a replica sees; none at TP 1. Qwen3-8B (36 layers, hidden 4096)."""
    per_token = 36 * 8 * 4096 * 2  # bytes of one token's activations through all the layers' collectives
    base = costs(lay=Layout(1, 1, 8, 1, 1)).train_per_token_s
    for tp, pp, dp in ((2, 1, 4), (8, 1, 1), (4, 2, 1)):
        c = costs(lay=Layout(tp, pp, dp, 1, 1))
        comm = per_token / pp * (tp - 1) / tp / dp / (450e9 * EFF["link"]) * pp  # bubble: 1 micro-batch
        compute = base * 8 / (tp * pp * dp) * pp
        assert c.train_per_token_s == pytest.approx(compute + comm, rel=1e-9)
        assert c.logprob_per_token_s == pytest.approx(compute / 3 + comm / 2, rel=1e-9)
    # at TP 8 on 8 GPUs the traffic adds about half the compute: wider TP is not free
    tp8 = costs(lay=Layout(8, 1, 1, 1, 1)).train_per_token_s
    assert 1.4 < tp8 / base < 1.7
