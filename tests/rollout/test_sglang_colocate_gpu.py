"""The colocated swap against a live SGLang 0.5.23 server on one GPU (docs/colocate.md): the engine gives back
its memory (release of kv_cache, weights, cuda_graph), takes back its weights' memory, receives new weights
from CUDA tensors of this process on the same GPU (update_weights_from_tensor, CUDA IPC), takes back its KV
cache, and generates with the new weights. The client calls are the project's (rollout/memory_occupation.py).

Needs a CUDA GPU, sglang (with torch_memory_saver, which it pins) and a small local model
(M2PO_SGLANG_TEST_MODEL, default Qwen/Qwen2.5-0.5B-Instruct from the HF cache). Not run yet: no GPU machine with
sglang has been available to this project (docs/colocate.md, "What ran on a GPU")."""
import asyncio
import json
import os

import pytest
import torch

from m2po_megatron.convert.export import hf_buckets
from m2po_megatron.rollout import _http
from m2po_megatron.rollout.client import RolloutClient
from m2po_megatron.rollout.launcher import EngineManager, ServerSpec
from m2po_megatron.rollout.memory_occupation import (KV, TAGS_ALL, WEIGHTS, release_memory, resume_memory,
                                                     serialize_named_tensors, update_weights_from_tensor)
from tests.rollout.conftest import hf_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
TOL = 2e-3  # fp32 on GPU, as test_sglang_gpu.py
KEY = "gpu-colocate-key"
PROMPT = [151644, 872, 198, 9707]
T = 120.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("sglang")
    pytest.importorskip("torch_memory_saver")
    model = os.environ.get("M2PO_SGLANG_TEST_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
    spec = ServerSpec(model_path=model, engine="sglang", dtype="float32", mem_fraction_static=0.5,
                      random_seed=0, api_key=KEY,
                      extra_args=("--enable-memory-saver", "--cuda-graph-backend-decode", "disabled",
                                  "--cuda-graph-backend-prefill", "disabled"))
    mgr = EngineManager([spec], run_dir=str(tmp_path_factory.mktemp("sglang")), use_ray=False, max_restarts=0)
    (url,) = mgr.start()
    yield model, url
    mgr.shutdown()


def _gen(url, n=2):
    async def run():
        async with RolloutClient([url], api_key=KEY) as c:
            return await c.generate(PROMPT, {"temperature": 1.0, "max_new_tokens": 16}, n=n)
    return asyncio.run(run())


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_release_update_from_tensors_and_resume(server):
    from transformers import AutoModelForCausalLM

    model_path, url = server
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).cuda().eval()
    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g, device="cuda"))
    weights_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())

    before = _free()
    release_memory(url, KEY, TAGS_ALL, T)
    freed = _free() - before
    assert freed >= weights_bytes // 2, (freed, weights_bytes)  # weights and KV pool left the GPU
    status, _ = _http.request(f"{url}/health_generate", api_key=KEY, timeout=30)
    assert status != 200  # a released engine does not generate

    resume_memory(url, KEY, WEIGHTS, T)
    for bucket in hf_buckets(hf.named_parameters(), bucket_bytes=64 << 20):
        update_weights_from_tensor(url, KEY, [serialize_named_tensors(bucket)], "1", T)  # CUDA IPC, same GPU
    resume_memory(url, KEY, KV, T)

    for s in _gen(url):
        assert s.token_versions == [1] * len(s.output_ids)
        ref = hf_logprobs(hf.cpu(), PROMPT, s.output_ids)
        hf.cuda()
        assert (ref - torch.tensor(s.output_logprobs)).abs().max() <= TOL
    info = json.loads(_http.request(f"{url}/get_model_info", api_key=KEY)[1])
    assert info.get("weight_version") == "1"
