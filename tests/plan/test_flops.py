"""plan/flops.py: the training FLOPs count, by hand for Qwen3-1.7B, and the planner's trainer cost built on it."""
import json
from pathlib import Path

import pytest

from m2po_megatron.models.memory import model_shape, param_count
from m2po_megatron.plan import costs, flops
from m2po_megatron.plan.hardware import GPUS

CONFIGS = Path(__file__).resolve().parents[2] / "m2po_megatron" / "assets" / "configs"
Q17 = json.loads((CONFIGS / "Qwen__Qwen3-1.7B-Base" / "config.json").read_text())


def test_qwen3_1p7b_by_hand():
    s, n = model_shape(Q17), param_count(Q17)
    # hidden 2048, 28 layers, 16 query heads and 8 KV heads of 128, SwiGLU 6144, vocab 151,936, tied embeddings
    layer = (2048 * 16 * 128 + 2 * 2048 * 8 * 128 + 16 * 128 * 2048  # q, k, v, o
             + 3 * 2048 * 6144  # gate, up, down
             + 2 * 2048 + 2 * 128)  # the two RMSNorms, q_norm and k_norm
    hand = 28 * layer + 151936 * 2048 + 2048  # the one table (tied: the output projection too), the final norm
    assert n == hand == 1_720_574_976
    assert flops.matmul_params(s, n) == hand  # tied: the table is the logit layer's matmul, counted once
    ctx = 4096
    per_token = 6 * hand + 12 * 28 * 16 * 128 * ctx / 2  # causal: a token attends to ctx / 2 on average
    assert flops.train_flops_per_token(s, n, ctx) == per_token
    assert flops.train_flops(s, n, [ctx, 100]) == ctx * per_token + 100 * (6 * hand + 12 * 28 * 16 * 128 * 50)


def test_the_planner_prices_the_same_count():
    """costs.py imports the count (one formula): the trainer's seconds per token at MFU 1 and dp 1 are it over
    the peak; its old names still import from costs."""
    assert costs.matmul_params is flops.matmul_params and costs.attention_flops is flops.attention_flops
    s, n = model_shape(Q17), param_count(Q17)
    c = costs.from_hardware(s, n, costs.Layout(1, 1, 1, 1, 1), "h200", micro_batches=1, mean_context=2000.0,
                            efficiency={"mfu": 1.0})
    assert c.train_per_token_s * GPUS["h200"].bf16_tflops * 1e12 == pytest.approx(
        flops.train_flops_per_token(s, n, 2000.0), rel=1e-12)
    assert c.logprob_per_token_s == pytest.approx(c.train_per_token_s * flops.FORWARD_ONLY_SHARE, rel=1e-12)
