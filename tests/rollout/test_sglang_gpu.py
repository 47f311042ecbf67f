"""The rollout checks against a live SGLang 0.5.23 server (needs a CUDA GPU, sglang, and a small local model):
the launcher's command, log-probs, the refusals the CPU server mirrors, seeds with deterministic inference,
the weight-update session and a full NCCL sync.

M2PO_SGLANG_TEST_MODEL: a local HF model directory (default: Qwen/Qwen2.5-0.5B-Instruct from the HF cache).
Skipped on CPU machines."""
import asyncio
import json
import os

import pytest
import torch

from m2po_megatron.rollout import _http
from m2po_megatron.rollout.client import RolloutClient, SyncRolloutClient
from m2po_megatron.rollout.launcher import EngineManager, ServerSpec
from m2po_megatron.convert.export import hf_buckets
from m2po_megatron.rollout.weight_sync import DistributedWeightSync
from tests.rollout.conftest import hf_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
TOL = 2e-3  # fp32 on GPU: different kernels than the HF reference (CPU runs match to 1e-5)
KEY = "gpu-test-key"
PROMPT = [151644, 872, 198, 9707]


@pytest.fixture(scope="module")
def sglang_server(tmp_path_factory):
    pytest.importorskip("sglang")
    model = os.environ.get("M2PO_SGLANG_TEST_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")
    spec = ServerSpec(model_path=model, engine="sglang", dtype="float32", mem_fraction_static=0.3,
                      random_seed=0, api_key=KEY, enable_deterministic_inference=True,
                      extra_args=("--cuda-graph-backend-decode", "disabled",
                                  "--cuda-graph-backend-prefill", "disabled"))
    mgr = EngineManager([spec], run_dir=str(tmp_path_factory.mktemp("sglang")), use_ray=False, max_restarts=0)
    (url,) = mgr.start()
    yield model, url
    mgr.shutdown()


@pytest.fixture(scope="module")
def hf_model(sglang_server):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(sglang_server[0], dtype=torch.float32).cuda().eval()


def _post(url, path, body):
    status, text = _http.request(f"{url}{path}", body, api_key=KEY)
    return status, json.loads(text) if text.strip().startswith("{") else text


def _gen(url, sp, n):
    async def run():
        async with RolloutClient([url], api_key=KEY) as c:
            return await c.generate(PROMPT, sp, n=n)
    return asyncio.run(run())


def test_what_the_cpu_server_mirrors(sglang_server):
    _, url = sglang_server
    assert _post(url, "/generate", {"input_ids": [1, 2], "no_such_field": 1,
                                    "sampling_params": {"max_new_tokens": 2}})[0] == 200
    status, out = _post(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"min_new_tokens": 1}})
    assert status == 400 and "skip_tokenizer_init" in json.dumps(out)
    status, out = _post(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**7}})
    assert status == 400 and "context length" in json.dumps(out)


def test_seeds_with_deterministic_inference(sglang_server):
    _, url = sglang_server
    sp = {"temperature": 1.0, "max_new_tokens": 24, "sampling_seed": 1234, "ignore_eos": True}
    a, b = _gen(url, sp, 2), _gen(url, sp, 2)
    assert [s.output_ids for s in a] == [s.output_ids for s in b]
    assert a[0].output_ids != a[1].output_ids  # sample i uses seed + i


def test_updates_need_the_session(sglang_server):
    _, url = sglang_server
    body = {"names": [], "dtypes": [], "shapes": [], "flush_cache": False}
    status, out = _post(url, "/update_weights_from_distributed", body)
    assert status == 400 and "begin_weight_update" in out["message"]
    assert _post(url, "/end_weight_update", {})[0] == 400
    assert _post(url, "/begin_weight_update", {})[0] == 200
    assert _post(url, "/begin_weight_update", {})[0] == 400
    assert _post(url, "/end_weight_update", {})[0] == 200


def test_logprobs_and_full_weight_sync_nccl(sglang_server, hf_model):
    _, url = sglang_server
    for s in _gen(url, {"temperature": 1.0, "max_new_tokens": 16}, 2):
        ref = hf_logprobs(hf_model.cpu(), PROMPT, s.output_ids)
        assert (ref - torch.tensor(s.output_logprobs)).abs().max() <= TOL
    hf_model.cuda()
    sync = DistributedWeightSync([url], api_key=KEY, backend="nccl", pause_mode="retract")
    sync.init_group()
    try:
        g = torch.Generator(device="cuda").manual_seed(1)
        with torch.no_grad():
            for _, p in hf_model.named_parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g, device="cuda"))
        stats = sync.sync(hf_buckets(hf_model.named_parameters(), bucket_bytes=64 << 20), weight_version=1)
        assert stats["num_buckets"] > 1 and stats["gb_per_s"] > 0
        for s in _gen(url, {"temperature": 1.0, "max_new_tokens": 16}, 2):
            assert s.token_versions == [1] * len(s.output_ids)
            ref = hf_logprobs(hf_model.cpu(), PROMPT, s.output_ids)
            assert (ref - torch.tensor(s.output_logprobs)).abs().max() <= TOL
            hf_model.cuda()
        info = json.loads(_http.request(f"{url}/get_model_info", api_key=KEY)[1])
        assert info.get("weight_version") == "1"

        # in_place: a running request keeps its KV cache and continues with the new weights (no flush)
        client = SyncRolloutClient([url], api_key=KEY)
        try:
            fut = client.submit(PROMPT, {"max_new_tokens": 2000, "ignore_eos": True}, n=1)
            sync.pause_mode = "in_place"
            sync.sync(hf_buckets(hf_model.named_parameters()), weight_version=2)
            s = fut.result(600)[0]
        finally:
            client.close()
        versions = [sp["version"] if isinstance(sp, dict) else sp[0] for sp in s.meta_info["weight_versions"]]
        assert versions[-1] == "2" and set(versions) <= {"1", "2"}
    finally:
        sync.close()
