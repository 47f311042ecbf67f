"""The remote reward's requests (reward/remote_protocol.py) are what SGLang 0.5.23 serves, and what it answers is
what we read: the `sglang_rm` body parses as SGLang's EmbeddingReqInput on its /classify route (a batch of
texts), the `openai_judge` body as its ChatCompletionRequest on /v1/chat/completions, our bearer header passes
its --api-key check; a real TokenizerManager turns a reward model's scores (BatchEmbeddingOutput) into the
/classify answer we parse, and SGLang's ChatCompletionResponse carries the judge's reply we parse."""
import asyncio
import dataclasses
import secrets
from urllib.parse import urlsplit

import pytest

from m2po_megatron.reward.remote_protocol import RemoteArgs, build_body, endpoint, headers, parse_answer
from m2po_megatron.reward.types import RewardInput

pytestmark = pytest.mark.timeout(300)

ITEMS = [RewardInput(response=f"The answer is {i}.", token_ids=[5, i], row={"answer": str(i), "q": f"What is {i}?"},
                     prompt=f"<|im_start|>user\nWhat is {i}?<|im_end|>\n<|im_start|>assistant\n") for i in range(3)]
RM_TEMPLATE = "{prompt}{response}<|im_end|>\n"


def args(kind: str, **kw) -> RemoteArgs:
    return RemoteArgs.from_args({"url": "http://rm.example:30000", "kind": kind, **kw})


def path_of(a: RemoteArgs) -> str:
    return urlsplit(endpoint(a)).path


def test_our_endpoints_are_sglang_routes_that_take_post(sglang_http):
    for a in (args("sglang_rm"), args("openai_judge"), args("openai_judge", url="https://judge.example/v1")):
        assert "POST" in sglang_http.routes[path_of(a)], path_of(a)
    assert path_of(args("sglang_rm")) == "/classify"
    assert path_of(args("openai_judge", url="https://judge.example/v1")) == "/v1/chat/completions"


@pytest.mark.parametrize("n", [1, 3])
def test_sglang_rm_request_is_a_batch_of_sglangs_embedding_request(sglang_http, n):
    from sglang.srt.managers.io_struct import EmbeddingReqInput

    a = args("sglang_rm", rm_template=RM_TEMPLATE)
    body = build_body(a, ITEMS[:n])
    status, text = sglang_http.request("POST", "/classify", body)  # FastAPI parses it into EmbeddingReqInput
    assert status == 200, text
    assert set(body) <= {f.name for f in dataclasses.fields(EmbeddingReqInput)}  # nothing we send is ignored
    obj = EmbeddingReqInput(**body)
    obj.normalize_batch_and_arguments()
    assert not obj.is_single and obj.batch_size == n  # a list even of one: the answer is a list, in order
    assert obj.text[0] == ITEMS[0].prompt + ITEMS[0].response + "<|im_end|>\n"
    # the harness really parses: a body SGLang's model refuses is refused
    assert sglang_http.request("POST", "/classify", {"text": {"not": "texts"}})[0] != 200


def test_we_read_the_classify_answer_sglangs_tokenizer_manager_builds(tm):
    """A reward model's per-text scores as the scheduler hands them over (BatchEmbeddingOutput), through the
    real TokenizerManager's output handling, serialised as the route does: our parser reads them in order."""
    import orjson
    from sglang.srt.managers.io_struct import BatchEmbeddingOutput, EmbeddingReqInput

    a = args("sglang_rm", rm_template=RM_TEMPLATE, score_scale=2.0)
    rids = [f"rm-{i}" for i in range(3)]
    obj = EmbeddingReqInput(**build_body(a, ITEMS), rid=rids)
    obj.normalize_batch_and_arguments()
    tm._init_req_state(obj, None)
    states = [tm.rid_to_state[r] for r in rids]
    recv = BatchEmbeddingOutput(rids=rids, finished_reasons=[{"type": "stop"}] * 3,
                                embeddings=[[0.25], [-1.5], [3.0]], prompt_tokens=[7, 7, 7], cached_tokens=[0, 0, 0],
                                placeholder_tokens_idx=None, placeholder_tokens_val=None, retraction_counts=[0, 0, 0])
    asyncio.run(tm._handle_batch_output(recv))
    answer = orjson.dumps([s.out_list[-1] for s in states]).decode()  # the batch's outputs, in request order
    assert [v[0] for v in parse_answer(a, answer, 3)] == [0.5, -3.0, 6.0]


@pytest.mark.parametrize("kw", [{}, {"model": "judge-7b", "judge_system": "Grade strictly.", "max_tokens": 256,
                                     "temperature": None, "prompt_key": "q",
                                     "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}])
def test_openai_judge_request_is_sglangs_chat_completion_request(sglang_http, kw):
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    a = args("openai_judge", **kw)
    body = build_body(a, ITEMS[1:2])
    status, text = sglang_http.request("POST", "/v1/chat/completions", body)
    assert status == 200, text
    assert set(body) <= set(ChatCompletionRequest.model_fields)  # nothing we send is ignored
    req = ChatCompletionRequest.model_validate(body)
    assert req.max_completion_tokens == a.max_tokens and req.max_tokens is None  # not the deprecated field
    assert req.temperature == a.temperature and req.model == (a.model or "default")
    assert [m.role for m in req.messages] == (["system", "user"] if a.judge_system else ["user"])
    user = req.messages[-1].content
    assert "The answer is 1." in user and ("What is 1?" in user) and "\n1\n" in user  # response, prompt, label
    if "extra_body" in kw:
        assert req.chat_template_kwargs == {"enable_thinking": False}


def test_we_read_the_judge_reply_in_sglangs_chat_completion_response():
    from sglang.srt.entrypoints.openai.protocol import (ChatCompletionResponse, ChatCompletionResponseChoice,
                                                        ChatMessage, UsageInfo)

    def answer(content, finish="stop"):
        return ChatCompletionResponse(id="c-1", model="judge", usage=UsageInfo(prompt_tokens=9, completion_tokens=4,
                                                                                 total_tokens=13),
                                      choices=[ChatCompletionResponseChoice(
                                          index=0, finish_reason=finish,
                                          message=ChatMessage(role="assistant", content=content))]).model_dump_json()

    a = args("openai_judge")
    assert parse_answer(a, answer('Mostly right, 2 slips.\n{"score": 0.75}'), 1)[0][0] == 0.75
    assert parse_answer(a, answer("Score: 0.5"), 1)[0][0] == 0.5
    score, _, why = parse_answer(a, answer(None, "length"), 1)[0]
    assert score is None and "max_tokens" in why


def test_our_bearer_header_passes_sglangs_api_key_check():
    """SGLang's --api-key middleware decides by decide_request_auth at the routes' own auth level."""
    from sglang.srt.entrypoints import http_server
    from sglang.srt.utils.auth import _get_auth_level_from_app_and_scope, decide_request_auth

    key = secrets.token_hex(16)
    for a in (args("sglang_rm"), args("openai_judge")):
        path = path_of(a)
        level = _get_auth_level_from_app_and_scope(http_server.app, {"type": "http", "path": path, "method": "POST"})

        def decide(header):
            return decide_request_auth(method="POST", path=path, authorization_header=header, api_key=key,
                                       admin_api_key=None, auth_level=level)

        assert decide(headers(key).get("Authorization")).allowed
        refused = [decide(headers(k).get("Authorization")) for k in (None, "wrong-" + key)]
        assert [(d.allowed, d.error_status_code) for d in refused] == [(False, 401)] * 2  # http_401: not retried


def test_reward_model_checkpoints_are_served_as_such_without_is_embedding():
    """docs/reward-service.md: SGLang serves a checkpoint with a reward / sequence-classification head as a
    non-generative model by its architecture (no --is-embedding); a CausalLM checkpoint would need the flag
    and then yields hidden states, not rewards."""
    from sglang.srt.configs.model_config import is_generation_model

    for arch in ("LlamaForSequenceClassification", "Qwen2ForSequenceClassification", "Qwen3ForSequenceClassification",
                 "Qwen2ForRewardModel", "Qwen3ForRewardModel", "InternLM2ForRewardModel",
                 "Gemma2ForSequenceClassification"):
        assert not is_generation_model([arch]), arch
    assert is_generation_model(["Qwen2ForCausalLM"]) and not is_generation_model(["Qwen2ForCausalLM"], True)
