"""rollout.dtype=bfloat16 on the CPU server: it samples and scores in bf16 while the trainer computes in
fp32, a real engine mismatch of the size bf16 gives (nonzero, far below the log-probs themselves)."""
import asyncio

import pytest
import torch

from m2po_megatron.rollout.client import RolloutClient
from m2po_megatron.rollout.engine import load_model
from m2po_megatron.rollout.launcher import ServerSpec, preflight
from tests.rollout.conftest import hf_logprobs, local_server

pytestmark = pytest.mark.timeout(240)


def test_bf16_server_logprobs_differ_from_fp32_by_bf16_rounding(tiny_model_dir, tmp_path):
    fp32 = load_model(str(tiny_model_dir)).eval()
    with local_server(tiny_model_dir, tmp_path, dtype="bfloat16") as srv:
        async def go():
            async with RolloutClient([srv.url]) as c:
                return await c.generate([5, 6, 7, 8], {"max_new_tokens": 16, "ignore_eos": True,
                                                       "sampling_seed": 3}, n=4)

        samples = asyncio.run(go())
    diffs = torch.cat([hf_logprobs(fp32, [5, 6, 7, 8], s.output_ids) - torch.tensor(s.output_logprobs)
                       for s in samples])
    assert diffs.abs().max() > 1e-4  # bf16 rounding shows (the fp32 server matches to 1e-5)
    assert diffs.abs().mean() < 0.1  # ... and is rounding, not another model


def test_cpu_server_dtypes_are_checked_before_start(tiny_model_dir):
    load_model(str(tiny_model_dir), "bfloat16")  # accepted
    with pytest.raises(ValueError, match="bfloat16"):
        load_model(str(tiny_model_dir), "float16")
    with pytest.raises(ValueError, match="dtype='half'"):
        preflight(ServerSpec(model_path=str(tiny_model_dir), engine="local", dtype="half"))
