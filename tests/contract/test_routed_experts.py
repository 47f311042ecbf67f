"""Rollout routing replay (R3) against SGLang 0.5.23's own code: the launch flag its parser reads, the request
field its request classes carry to the scheduler, the rows its capturer returns (positions [0, seqlen - 1)),
the encoding its response builders write (base64 of int32 [rows, layers, top_k], by the TokenizerManager
under --skip-tokenizer-init and by the DetokenizerManager otherwise) decoded by ours, and the CPU server's
answer for a MoE model read by SGLang's own decoder."""
import argparse
import asyncio
import json
import os
import subprocess
import warnings
from array import array
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from m2po_megatron.rollout import _http, routing
from m2po_megatron.rollout.client import RolloutClient, build_batch_body, build_generate_body
from m2po_megatron.rollout.launcher import ServerSpec, build_command

pytestmark = pytest.mark.timeout(300)
L, K, E = 2, 2, 4  # tests/rollout/conftest.py make_tiny_qwen3_moe


def _sglang_parser():
    warnings.filterwarnings("ignore")
    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(p)
    return p


def test_launch_flag_reads_as_meant():
    from m2po_megatron.rollout.local_server import parser as local_parser

    for engine in ("sglang", "local"):
        argv = build_command(ServerSpec(model_path="/m", engine=engine, enable_return_routed_experts=True))[3:]
        assert "--enable-return-routed-experts" in argv
        assert _sglang_parser().parse_args(argv).enable_return_routed_experts is True
    assert local_parser().parse_args(argv).enable_return_routed_experts is True
    off = build_command(ServerSpec(model_path="/m", engine="sglang"))[3:]
    assert _sglang_parser().parse_args(off).enable_return_routed_experts is False


def test_request_field_reaches_the_scheduler(sglang_http):
    """Our bodies pass SGLang's HTTP layer, and its TokenizerManager hands return_routed_experts (with start 0:
    the whole sequence) to the scheduler for a single request and for every sample of a batch request."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    single = build_generate_body([1, 2, 3], {"max_new_tokens": 4}, "r-1", return_routed_experts=True)
    batch = build_batch_body([1, 2, 3], {"max_new_tokens": 4}, [5, 6], return_routed_experts=True)
    for body in (single, batch):
        status, text = sglang_http.request("POST", "/generate", body)
        assert status == 200, text
        obj = GenerateReqInput(**json.loads(json.dumps(body)))
        obj.normalize_batch_and_arguments()
        subs = [obj] if obj.is_single else [obj[i] for i in range(obj.batch_size)]
        for sub in subs:
            t = asyncio.run(sglang_http.tm._tokenize_one_request(sub))
            assert t.return_routed_experts is True and t.routed_experts_start_len == 0
    plain = GenerateReqInput(**build_generate_body([1, 2], {}, "r-2"))
    assert plain.return_routed_experts is False  # not asked: SGLang's default


def test_rows_are_every_fed_position():
    """BaseTopkCapturer.get_topk with start 0 returns the host rows of positions [0, seqlen - 1), seqlen being
    prompt + output (SchedulerBatchResultProcessor._maybe_collect_routed_experts): expected_rows."""
    from sglang.srt.state_capturer.base import BaseTopkCapturer

    prompt, output = 5, 3
    host = torch.arange(100 * L * K, dtype=torch.int32).reshape(100, L, K)
    slots = torch.arange(40, 40 + prompt + output)  # where the request's tokens sit in the KV pool
    fake = SimpleNamespace(host_cache=SimpleNamespace(buffer=host))
    pool = SimpleNamespace(req_to_token=slots[None])
    rows = BaseTopkCapturer.get_topk(fake, req_pool_idx=0, seqlen=prompt + output, req_to_token_pool=pool)
    assert rows.shape == (routing.expected_rows(prompt, output), L, K)
    assert torch.equal(rows, host[40:40 + prompt + output - 1])


def _answer(tm, routed, *, detokenized: bool):
    """SGLang's /generate answer for one finished request carrying `routed` (int32 [rows, L, K])."""
    import orjson
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    from sglang.srt.managers.io_struct import BatchTokenIDOutput, GenerateReqInput
    from sglang.srt.utils.weight_versions import WeightVersionSpan

    out_ids = [7, 8, 9]
    obj = GenerateReqInput(rid="r-1", input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 8},
                           return_logprob=True, return_routed_experts=True)
    obj.normalize_batch_and_arguments()
    tm._init_req_state(obj, None)
    state = tm.rid_to_state["r-1"]
    none = [None]
    # the detokenizer's encoding (BatchStrOutput path) or the tensor itself (skip_tokenizer_init path)
    wire = DetokenizerManager._b64_encode_per_request([routed])[0] if detokenized else routed
    recv = BatchTokenIDOutput(
        rids=["r-1"], finished_reasons=[{"type": "length", "length": 3}], decoded_texts=[""],
        decode_ids=[array("q", out_ids)], read_offsets=[0], output_ids=[array("q", out_ids)],
        skip_special_tokens=[True], spaces_between_special_tokens=[True], no_stop_trim=[False], prompt_tokens=[3],
        reasoning_tokens=[0], completion_tokens=[3], cached_tokens=[0], input_token_logprobs_val=[],
        input_token_logprobs_idx=[], output_token_logprobs_val=[[-0.5] * 3], output_token_logprobs_idx=[out_ids],
        input_top_logprobs_val=[], input_top_logprobs_idx=[], output_top_logprobs_val=none,
        output_top_logprobs_idx=none, input_token_ids_logprobs_val=[], input_token_ids_logprobs_idx=[],
        output_token_ids_logprobs_val=none, output_token_ids_logprobs_idx=none, output_token_entropy_val=None,
        output_token_sampling_mask=None, output_hidden_states=None, routed_experts=[wire], indexer_topk=None,
        placeholder_tokens_idx=None, placeholder_tokens_val=None, retraction_counts=[0],
        weight_versions=[[WeightVersionSpan(version="0", start=0, end=3)]])
    asyncio.run(tm._handle_batch_output(recv))
    return orjson.loads(orjson.dumps(state.out_list[-1]))


@pytest.mark.parametrize("detokenized", [False, True], ids=["skip_tokenizer_init", "detokenizer"])
def test_client_decodes_what_sglang_writes(tm, detokenized):
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    rng = np.random.default_rng(0)
    rows = routing.expected_rows(3, 3)
    want = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(rows)])
    answer = _answer(tm, torch.from_numpy(want.astype(np.int32)), detokenized=detokenized)
    s = RolloutClient(["http://unused"])._parse(answer, "sglang")
    assert s.routed_experts == answer["meta_info"]["routed_experts"]
    got, problem = routing.parse(s.routed_experts, num_layers=L, topk=K, num_experts=E, num_tokens=rows)
    assert problem is None
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(extract_routed_experts_from_meta_info(answer), want.reshape(-1))
    assert routing.encode(want) == answer["meta_info"]["routed_experts"]  # the CPU server writes the same bytes


@pytest.fixture(scope="module")
def moe_cpu_server(tmp_path_factory):
    """The CPU server (project environment) on a tiny Qwen3-MoE, started with --enable-return-routed-experts."""
    from tests.contract.conftest import project_python, running_cpu_server

    model = tmp_path_factory.mktemp("tiny_qwen3_moe")
    subprocess.run([project_python(), "-c", "import sys; from tests.rollout.conftest import make_tiny_qwen3_moe; "
                    "make_tiny_qwen3_moe(sys.argv[1])", str(model)], check=True, timeout=240,
                   env=dict(os.environ, PYTHONPATH=os.getcwd()))
    with running_cpu_server(model, tmp_path_factory.mktemp("logs") / "moe_cpu_server.log",
                            enable_return_routed_experts=True) as url:
        yield url


def test_cpu_server_answers_as_sglang(tm, moe_cpu_server):
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    body = build_generate_body([1, 2, 3], {"max_new_tokens": 3, "ignore_eos": True}, "r-2",
                               return_routed_experts=True)
    status, text = _http.request(f"{moe_cpu_server}/generate", body)
    assert status == 200, text
    ours = json.loads(text)
    rows = routing.expected_rows(3, len(ours["output_ids"]))
    answer = _answer(tm, torch.zeros(rows, L, K, dtype=torch.int32), detokenized=True)
    assert set(ours) == set(answer)
    assert type(ours["meta_info"]["routed_experts"]) is type(answer["meta_info"]["routed_experts"]) is str
    flat = extract_routed_experts_from_meta_info(ours)  # SGLang's own reader
    assert flat.size == rows * L * K
    got, problem = routing.parse(ours["meta_info"]["routed_experts"], num_layers=L, topk=K, num_experts=E,
                                 num_tokens=rows)
    assert problem is None
    np.testing.assert_array_equal(got, flat.reshape(rows, L, K))
