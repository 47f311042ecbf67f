"""Seeds in the CPU engine mirror SGLang: sampling_seed counts only with deterministic inference
(--enable-deterministic-inference), where a request without one gets SGLang's default seed 42."""
import threading

import pytest
import torch

from m2po_megatron.rollout.engine import Engine, SamplingParams

pytestmark = pytest.mark.timeout(120)


def _sample(engine, seed):
    done = threading.Event()
    (seq,) = engine.submit([5, 6, 7], SamplingParams(max_new_tokens=12, ignore_eos=True, sampling_seed=seed), 1,
                           lambda s: done.set())
    assert done.wait(60)
    return seq.out


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


@pytest.mark.parametrize("deterministic", [False, True])
def test_sampling_seed_counts_only_with_deterministic_inference(model, deterministic):
    engine = Engine(model, random_seed=0, deterministic=deterministic)
    try:
        a, b = _sample(engine, 7), _sample(engine, 7)
        assert (a == b) is deterministic  # 12 tokens of a 384-token vocabulary never repeat by chance
        if deterministic:
            assert _sample(engine, None) == _sample(engine, 42) != a
    finally:
        engine.shutdown()
