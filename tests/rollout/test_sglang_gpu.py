"""The same checks against a real SGLang server (needs a CUDA GPU, sglang, and a small local model).

M2PO_SGLANG_TEST_MODEL: a local HF model directory (default: Qwen/Qwen2.5-0.5B-Instruct from the HF cache).
Written against SGLang 0.5.23's HTTP API; skipped on CPU machines."""
import asyncio
import json
import os

import pytest
import torch

from m2po_megatron.rollout import _http
from m2po_megatron.rollout.client import RolloutClient
from m2po_megatron.rollout.launcher import EngineManager, ServerSpec
from m2po_megatron.rollout.weight_sync import DistributedWeightSync, hf_buckets
from tests.rollout.conftest import hf_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
TOL = 2e-3  # fp32 on GPU: different kernels than the HF reference (CPU runs match to 1e-5)


@pytest.fixture(scope="module")
def sglang_server(tmp_path_factory):
    pytest.importorskip("sglang")
    model = os.environ.get("M2PO_SGLANG_TEST_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
    spec = ServerSpec(model_path=model, engine="sglang", dtype="float32", mem_fraction_static=0.3,
                      random_seed=0, api_key="gpu-test-key", extra_args=("--disable-cuda-graph",))
    mgr = EngineManager([spec], run_dir=str(tmp_path_factory.mktemp("sglang")), use_ray=False, max_restarts=0)
    (url,) = mgr.start()
    yield model, url
    mgr.shutdown()


@pytest.fixture(scope="module")
def hf_model(sglang_server):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(sglang_server[0], dtype=torch.float32).cuda().eval()


def test_unknown_field_refused(sglang_server):
    status, text = _http.request(f"{sglang_server[1]}/generate", {"input_ids": [1, 2], "no_such_field": 1},
                                 api_key="gpu-test-key")
    assert status >= 400, text


def test_logprobs_and_weight_sync_nccl(sglang_server, hf_model):
    _, url = sglang_server
    prompt = [151644, 872, 198, 9707]

    async def gen():
        async with RolloutClient([url], api_key="gpu-test-key") as c:
            return await c.generate(prompt, {"temperature": 1.0, "max_new_tokens": 16}, n=2)

    for s in asyncio.run(gen()):
        ref = hf_logprobs(hf_model.cpu(), prompt, s.output_ids)
        assert (ref - torch.tensor(s.output_logprobs)).abs().max() <= TOL
    hf_model.cuda()
    sync = DistributedWeightSync([url], api_key="gpu-test-key", backend="nccl", mode="pause")
    sync.init_group()
    try:
        g = torch.Generator(device="cuda").manual_seed(1)
        with torch.no_grad():
            for _, p in hf_model.named_parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g, device="cuda"))
        stats = sync.sync(hf_buckets(hf_model.named_parameters()), weight_version=1)
        assert stats["gb_per_s"] > 0
        for s in asyncio.run(gen()):
            assert s.token_versions == [1] * len(s.output_ids)
            ref = hf_logprobs(hf_model.cpu(), prompt, s.output_ids)
            assert (ref - torch.tensor(s.output_logprobs)).abs().max() <= TOL
            hf_model.cuda()
        info = json.loads(_http.request(f"{url}/get_model_info", api_key="gpu-test-key")[1])
        assert info.get("weight_version") == "1"
    finally:
        sync.close()
