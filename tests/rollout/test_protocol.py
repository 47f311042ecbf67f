"""Pure checks: contract validation, bodies built by the client and weight sync, sampling math, spans."""
import pytest
import torch

from m2po_megatron.convert.export import hf_buckets
from m2po_megatron.rollout import protocol, sampling
from m2po_megatron.rollout.client import build_generate_body
from m2po_megatron.rollout.launcher import ServerSpec, build_command
from m2po_megatron.rollout.weight_sync import init_group_body, update_body


@pytest.mark.parametrize("sp", [None, {}, {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8},
                                {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "stop_token_ids": [1, 2],
                                 "sampling_seed": 3, "max_new_tokens": 64, "n": 4}])
def test_generate_bodies_validate(sp):
    body = build_generate_body([5, 6, 7], sp, "rid-1", return_logprob=True)
    assert protocol.validate_request("POST /generate", body) is body
    assert "n" not in body["sampling_params"]  # the client expands n itself


@pytest.mark.parametrize("sp", [{"top_p": 1.5}, {"min_new_tokens": 2}, {"stop": ["\n"]}])
def test_client_refuses_what_the_server_would_refuse(sp):
    with pytest.raises(protocol.ProtocolError):
        build_generate_body([1, 2], sp, "rid")


def test_weight_sync_bodies_validate():
    protocol.validate_request("POST /init_weights_update_group",
                              init_group_body("10.0.0.1", 29500, 1, 3, "weight_update_group", "gloo"))
    bucket = [("model.embed_tokens.weight", torch.zeros(4, 2, dtype=torch.bfloat16)), ("lm_head.weight", torch.zeros(3))]
    body = update_body(bucket, "weight_update_group", "7", True)
    protocol.validate_request("POST /update_weights_from_distributed", body)
    assert body["dtypes"] == ["bfloat16", "float32"] and body["shapes"] == [[4, 2], [3]]
    for path, body in [("/pause_generation", {"mode": "retract"}), ("/continue_generation", {}),
                       ("/abort_request", {"abort_all": True}), ("/begin_weight_update", {}),
                       ("/end_weight_update", {})]:
        protocol.validate_request(f"POST {path}", body)


def test_unknown_top_level_fields_are_ours_to_refuse_but_sglang_ignores_them():
    body = {"input_ids": [1, 2], "no_such_field": 1, "sampling_params": {"max_new_tokens": 2}}
    with pytest.raises(protocol.ProtocolError, match="unknown field"):
        protocol.validate_request("POST /generate", body)
    assert protocol.validate_request("POST /generate", body, strict=False) is body
    with pytest.raises(protocol.ProtocolError, match="max_tokens"):  # the contract gate rejects these
        protocol.validate_request("POST /generate", {"input_ids": [1], "sampling_params": {"max_tokens": 3}},
                                  strict=False)


@pytest.mark.parametrize("sp,needle", [
    ({"min_new_tokens": 1}, "min_new_tokens=1 is unavailable"),
    ({"stop": "x"}, "stop=\\['x'\\] is unavailable"),
    ({"stop": ""}, "is unavailable"),  # SGLang turns "" into [""], which is a stop list
    ({"stop_regex": ["a+"]}, "stop_regex"),
    ({"top_k": 0}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"temperature": -0.1}, "temperature"),
    ({"min_new_tokens": 5, "max_new_tokens": 3}, "min_new_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"sampling_seed": 2**63}, "sampling_seed"),
    ({"regex": "a", "ebnf": "b"}, "Only one of"),
    ({"logit_bias": {"999": 1.0}}, "logit_bias"),
])
def test_sampling_params_refused_as_sglang_does_under_skip_tokenizer_init(sp, needle):
    with pytest.raises(protocol.ProtocolError, match=needle):
        protocol.sampling_params(sp, tokenizer=False, vocab_size=100)


def test_sampling_params_normalized_as_sglang_does():
    out = protocol.sampling_params({"temperature": 0.0, "top_k": 5, "stop": [], "top_p": None})
    assert (out["temperature"], out["top_k"], out["top_p"]) == (1.0, 1, 1.0)  # greedy = top-1 at T=1
    assert protocol.sampling_params({"top_k": -1})["top_k"] == protocol.TOP_K_ALL
    assert protocol.sampling_params({"min_new_tokens": 1}, tokenizer=True)["min_new_tokens"] == 1
    assert protocol.sampling_params({})["max_new_tokens"] == 128


@pytest.mark.parametrize("n_in,requested,limit,expect", [
    (3, 13, 13, (3, 11)),          # prompt + max_new_tokens == context: accepted, the last 2 never generated
    (3, None, 128, (3, 11)),       # the default 128 is not checked against the context, only capped
    (3, None, None, (3, 11)),      # max_new_tokens: null = no limit but the context
    (3, 5, 5, (3, 5)),
    (9, 1, 1, (9, 1)),             # 9 < 16 - 6
])
def test_length_rules_accept(n_in, requested, limit, expect):
    assert protocol.check_lengths(n_in, requested, limit, 16) == expect


@pytest.mark.parametrize("n_in,requested,needle", [
    (3, 14, "Requested token count exceeds"),
    (16, 0, "longer than the model's context length"),
    (10, 1, "Input length \\(10 tokens\\) exceeds the maximum allowed length \\(10 tokens\\)"),
])
def test_length_rules_refuse_and_auto_truncate(n_in, requested, needle):
    with pytest.raises(protocol.ProtocolError, match=needle):
        protocol.check_lengths(n_in, requested, requested, 16)
    kept, new = protocol.check_lengths(n_in, requested, requested, 16, allow_auto_truncate=True)
    assert kept <= 10 and kept + new <= 14


@pytest.mark.parametrize("args,needle", [
    (("--disable-cuda-graph",), "deprecated"),
    (("--no-such-flag",), "not a flag"),
    (("--tp-size",), "needs a value"),
    (("--tp-size", "two"), "needs an int"),
    (("--attention-backend", "nope"), "not one of"),
    (("--allow-auto-truncate=1",), "takes no value"),
    (("fa3",), "not a flag"),
])
def test_launch_args_refused_as_sglang_parser_would(args, needle):
    with pytest.raises(ValueError, match=needle):
        protocol.check_launch_args(list(args))


def test_real_sglang_flags_pass():
    protocol.check_launch_args(["--cuda-graph-backend-decode", "disabled", "--allow-auto-truncate",
                                "--admin-api-key", "k", "--enable-deterministic-inference",
                                "--tensor-parallel-size", "2", "--mem-fraction-static=0.8"])


@pytest.mark.parametrize("endpoint,body,needle", [
    ("POST /generate", {"input_ids": [1], "temperature": 1.0}, "unknown field"),
    ("POST /generate", {"input_ids": ["a"]}, "input_ids"),
    ("POST /generate", {"input_ids": [1], "sampling_params": {"max_tokens": 3}}, "max_tokens"),
    ("POST /generate", {"input_ids": [1], "sampling_params": {"top_p": "high"}}, "top_p"),
    ("POST /pause_generation", {"mode": "stop"}, "mode"),
    ("POST /update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"]}, "shapes"),
    ("POST /init_weights_update_group", {"master_address": "h", "master_port": "1", "rank_offset": 1,
                                         "world_size": 2}, "master_port"),
])
def test_invalid_bodies_are_refused(endpoint, body, needle):
    with pytest.raises(protocol.ProtocolError, match=needle):
        protocol.validate_request(endpoint, body)


def test_every_contract_type_string_parses_to_a_checker():
    for ep, d in protocol.contract()["endpoints"].items():
        for name, spec in d["fields"].items():
            chk = protocol.type_checker(spec["type"])
            if spec["default"] not in ("<required>", None):
                assert chk(spec["default"]), (ep, name, spec)


def test_launch_command_uses_contract_flags():
    flags = set(protocol.launch_flags())
    cmd = build_command(ServerSpec(model_path="/m", engine="sglang", host="10.0.0.2", port=30001, tp_size=2,
                                   mem_fraction_static=0.8, context_length=4096, dtype="bfloat16",
                                   quantization="fp8", api_key="k", random_seed=1))
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    used = [a for a in cmd if a.startswith("--")]
    assert set(used) <= flags and {"--tp-size", "--quantization", "--skip-tokenizer-init", "--random-seed"} <= set(used)
    with pytest.raises(ValueError, match="not a flag"):
        build_command(ServerSpec(model_path="/m", engine="sglang", extra_args=("--no-such-flag",)))
    cmd = build_command(ServerSpec(model_path="/m", engine="local", enable_deterministic_inference=True))
    assert "--enable-deterministic-inference" in cmd
    with pytest.raises(ValueError, match="not supported by the CPU server"):
        build_command(ServerSpec(model_path="/m", engine="local", extra_args=("--attention-backend", "fa3")))


def test_returned_logprobs_are_plain_log_softmax_at_temperature_one():
    logits = torch.randn(3, 50)
    lp = sampling.returned_logprobs(logits, torch.ones(3))
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1))
    lp2 = sampling.returned_logprobs(logits, torch.full((3,), 0.5))
    torch.testing.assert_close(lp2, torch.log_softmax(logits * 2, -1))


def test_filtered_probs_top_k_top_p_min_p_and_greedy():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 5))
    t = torch.ones(5)
    top_p = torch.tensor([1.0, 1.0, 0.6, 1.0, 1.0])
    top_k = torch.tensor([-1, 2, -1, -1, -1])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.3, 0.0])
    temp = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    p = sampling.filtered_probs(logits, temp, top_p, top_k, min_p)
    torch.testing.assert_close(p[0], torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    torch.testing.assert_close(p[1], torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    torch.testing.assert_close(p[2], torch.tensor([0.5 / 0.7, 0.2 / 0.7, 0, 0, 0]))  # 0.5 < 0.6 so 2nd is kept
    torch.testing.assert_close(p[3], torch.tensor([0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0]))
    torch.testing.assert_close(p[4], torch.tensor([1.0, 0, 0, 0, 0]))
    toks = sampling.sample_rows(p, torch.arange(5), torch.zeros(5, dtype=torch.long))
    assert toks[1] in (0, 1) and toks[4] == 0


def test_spans_round_trip_and_fill():
    versions = ["1", "1", "2", "2", "2", "3"]
    spans = protocol.spans_from_versions(versions, "3")
    assert spans == [{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 2, "end": 5},
                     {"version": "3", "start": 5, "end": 6}]
    assert protocol.expand_weight_versions({"weight_versions": spans}, 6) == versions
    assert protocol.spans_from_versions([], "4") == [{"version": "4", "start": 0, "end": 0}]
    assert protocol.expand_weight_versions({"weight_versions": [["4", 0, 1]]}, 2) == ["4", "4"]
    with pytest.raises(ValueError, match="weight_versions"):  # SGLang 0.5.23 always sends them
        protocol.expand_weight_versions({"weight_version": "4"}, 2)
    with pytest.raises(ValueError, match="contiguous"):
        protocol.expand_weight_versions({"weight_versions": [{"version": "1", "start": 1, "end": 2}]}, 2)


def test_hf_buckets_respects_size():
    named = [(f"t{i}", torch.zeros(100)) for i in range(10)]  # 400 bytes each
    buckets = list(hf_buckets(named, bucket_bytes=1000))
    assert [len(b) for b in buckets] == [2, 2, 2, 2, 2]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
