"""What the client reads from a /generate answer is what SGLang's response builder writes: a real
TokenizerManager._handle_batch_output turns a scheduler output (BatchTokenIDOutput, as under
--skip-tokenizer-init) into the answer, and the client's parser reads ids, log-probs, per-token versions,
finish reason and prompt length from it. The CPU server's answers carry the same fields."""
import asyncio
import json
from array import array

import pytest

from m2po_megatron.rollout import _http
from m2po_megatron.rollout.client import RolloutClient

pytestmark = pytest.mark.timeout(300)


def _sglang_answer(tm, finish, spans, out_ids, logprobs):
    import orjson
    from sglang.srt.managers.io_struct import BatchTokenIDOutput, GenerateReqInput
    from sglang.srt.utils.weight_versions import WeightVersionSpan

    obj = GenerateReqInput(rid="r-1", input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 8},
                           return_logprob=True)
    obj.normalize_batch_and_arguments()
    tm._init_req_state(obj, None)
    state = tm.rid_to_state["r-1"]
    n = len(out_ids)
    none = [None]
    recv = BatchTokenIDOutput(
        rids=["r-1"], finished_reasons=[finish], decoded_texts=[""], decode_ids=[array("q", out_ids)],
        read_offsets=[0], output_ids=[array("q", out_ids)], skip_special_tokens=[True],
        spaces_between_special_tokens=[True], no_stop_trim=[False], prompt_tokens=[3], reasoning_tokens=[0],
        completion_tokens=[n], cached_tokens=[0], input_token_logprobs_val=[], input_token_logprobs_idx=[],
        output_token_logprobs_val=[logprobs], output_token_logprobs_idx=[out_ids], input_top_logprobs_val=[],
        input_top_logprobs_idx=[], output_top_logprobs_val=none, output_top_logprobs_idx=none,
        input_token_ids_logprobs_val=[], input_token_ids_logprobs_idx=[], output_token_ids_logprobs_val=none,
        output_token_ids_logprobs_idx=none, output_token_entropy_val=None, output_token_sampling_mask=None,
        output_hidden_states=None, routed_experts=None, indexer_topk=None, placeholder_tokens_idx=None,
        placeholder_tokens_val=None, retraction_counts=[0],
        weight_versions=[[WeightVersionSpan(version=v, start=s, end=e) for v, s, e in spans]])
    asyncio.run(tm._handle_batch_output(recv))
    return orjson.loads(orjson.dumps(state.out_list[-1]))  # as the route serialises it


def test_client_reads_sglangs_answer(tm):
    answer = _sglang_answer(tm, {"type": "length", "length": 4}, [("3", 0, 2), ("4", 2, 4)], [7, 8, 9, 10],
                            [-0.5, -1.0, -1.5, -2.0])
    s = RolloutClient(["http://unused"])._parse(answer, "sglang")
    assert s.output_ids == [7, 8, 9, 10] and s.output_logprobs == [-0.5, -1.0, -1.5, -2.0]
    assert s.token_versions == [3, 3, 4, 4] and s.weight_version == 4
    assert s.finish_reason == "length" and s.prompt_tokens == 3
    stop = _sglang_answer(tm, {"type": "stop", "matched": 10}, [("5", 0, 1)], [10], [-0.1])
    assert RolloutClient(["http://unused"])._parse(stop, "sglang").finish_reason == "stop"


def test_cpu_server_answers_with_the_same_fields(tm, cpu_server):
    answer = _sglang_answer(tm, {"type": "length", "length": 2}, [("default", 0, 2)], [7, 8], [-0.5, -1.0])
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True},
            "return_logprob": True, "rid": "r-2"}
    status, text = _http.request(f"{cpu_server.url}/generate", body)
    ours = json.loads(text)
    assert status == 200
    assert set(answer) == set(ours)
    read = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "weight_version", "weight_versions",
            "output_token_logprobs"}
    assert read <= set(answer["meta_info"]) and read <= set(ours["meta_info"])
    for key in read:
        assert type(ours["meta_info"][key]) is type(answer["meta_info"][key]), key
    assert [len(x) for x in ours["meta_info"]["output_token_logprobs"]] == \
        [len(x) for x in answer["meta_info"]["output_token_logprobs"]]
    assert set(ours["meta_info"]["weight_versions"][0]) == set(answer["meta_info"]["weight_versions"][0])


def test_server_info_has_what_the_weight_sync_checks(sglang_http, cpu_server):
    """DistributedWeightSync.check_servers reads dp_size, tp_size and pp_size from /get_server_info: SGLang's
    builder (build_server_info over the resolved ServerArgs) writes them, and the CPU server too."""
    from sglang.srt.utils.common import build_server_info

    real = build_server_info(sglang_http.tm.server_args, {})
    assert (real["dp_size"], real["tp_size"], real["pp_size"]) == (1, 1, 1)
    ours = json.loads(_http.request(f"{cpu_server.url}/get_server_info")[1])
    assert (ours["dp_size"], ours["tp_size"]) == (1, 1) and "api_key" not in ours
