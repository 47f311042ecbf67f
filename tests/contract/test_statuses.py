"""The same requests to SGLang's own HTTP layer (sglang_http.py) and to our CPU server get the same status
codes: what SGLang refuses the CPU server refuses, what it accepts the CPU server serves."""
import json

import pytest

from m2po_megatron.rollout import _http, protocol
from tests.contract.conftest import CONTEXT

pytestmark = pytest.mark.timeout(600)

SP = {"max_new_tokens": 4}
GENERATE = [
    {"input_ids": [1, 2, 3], "sampling_params": SP},
    {"input_ids": [1, 2, 3], "sampling_params": SP, "not_a_field": {"x": 1}, "rid": "r-1"},
    {"input_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}},
    {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": CONTEXT - 3}},
    {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": CONTEXT - 2}},
    {"input_ids": [2] * (CONTEXT - 6), "sampling_params": {"max_new_tokens": 1}},
    {"input_ids": [2] * (CONTEXT - 7), "sampling_params": {"max_new_tokens": 1}},
    {"input_ids": [2] * CONTEXT, "sampling_params": {"max_new_tokens": 0}},
    {"input_ids": [2] * 50},
    {"input_ids": [2] * 50, "sampling_params": {"max_new_tokens": None}},
    {"input_ids": [1, 2], "sampling_params": {"min_new_tokens": 1, "max_new_tokens": 4}},
    {"input_ids": [1, 2], "sampling_params": {"min_new_tokens": 0, "max_new_tokens": 4}},
    {"input_ids": [1, 2], "sampling_params": {"stop": "", "max_new_tokens": 4}},
    {"input_ids": [1, 2], "sampling_params": {"stop": [], "max_new_tokens": 4}},
    {"input_ids": [1, 2], "sampling_params": {"stop": ["a"], "max_new_tokens": 4}},
    {"input_ids": [1, 2], "sampling_params": {"stop_regex": "a+", "max_new_tokens": 4}},
    {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [1, None]}},
    {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [1, 5], "max_new_tokens": 4}},
    {"input_ids": [1, 2], "sampling_params": {"top_k": 0}},
    {"input_ids": [1, 2], "sampling_params": {"top_k": -2}},
    {"input_ids": [1, 2], "sampling_params": {"top_k": -1, "max_new_tokens": 4}},
    {"input_ids": [1, 2], "sampling_params": {"top_p": 0.0}},
    {"input_ids": [1, 2], "sampling_params": {"top_p": 0.5, "max_new_tokens": 4}},
    {"input_ids": [1, 2], "sampling_params": {"temperature": 0, "max_new_tokens": 4}},
    {"input_ids": [1, 2], "sampling_params": {"temperature": -1}},
    {"input_ids": [1, 2], "sampling_params": {"temperature": "1"}},
    {"input_ids": [1, 2], "sampling_params": {"min_p": 1.5}},
    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2.0}},
    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}},
    {"input_ids": [1, 2], "sampling_params": {"sampling_seed": 2**63}},
    {"input_ids": [1, 2], "sampling_params": {"sampling_seed": -5, "max_new_tokens": 4}},
    {"input_ids": [1, 2], "sampling_params": {"n": 2, "max_new_tokens": 3}},
    {"input_ids": [[1, 2], [3]], "sampling_params": {"n": 2, "max_new_tokens": 3}},
    {"input_ids": [[1, 2], [3]], "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 2}]},
    {"input_ids": []},
    {"input_ids": ["a"]},
    {"input_ids": [1.0]},
    {"input_ids": [1], "rid": 5},
    {"input_ids": [1], "return_logprob": 1},
    {"input_ids": [1], "return_logprob": True, "sampling_params": SP},
    {"input_ids": [1, 2], "return_routed_experts": True, "sampling_params": SP},  # a dense server: ignored
    {"text": "hello"},
    {"sampling_params": SP},
    [1, 2],
]


def _status(server, method, path, body):
    status, text = _http.request(f"{server.url}{path}", body, method=method)
    return status, text


@pytest.mark.parametrize("i", range(len(GENERATE)))
def test_generate_statuses_agree(sglang_http, cpu_server, i):
    body = GENERATE[i]
    want, why = sglang_http.request("POST", "/generate", body)
    got, text = _status(cpu_server, "POST", "/generate", body)
    assert got == want, f"{body!r:.200}: SGLang {want} ({why[:300]}), CPU server {got} ({text[:300]})"


# SGLang serves these, the CPU server cannot (no streaming, penalties, logit bias, grammars); it must refuse
# them loudly (400 naming the field), never ignore them.
CPU_LIMITS = [
    {"input_ids": [1, 2], "stream": True},
    {"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 0.5}},
    {"input_ids": [1, 2], "sampling_params": {"logit_bias": {"3": 1.0}}},
    {"input_ids": [1, 2], "sampling_params": {"json_schema": "{}"}},
]


@pytest.mark.parametrize("i", range(len(CPU_LIMITS)))
def test_what_only_sglang_serves_is_refused_loudly(sglang_http, cpu_server, i):
    assert sglang_http.request("POST", "/generate", CPU_LIMITS[i])[0] == 200
    status, text = _status(cpu_server, "POST", "/generate", CPU_LIMITS[i])
    assert status == 400 and "not supported" in text


CONTROL = [  # requests whose answer does not depend on server state
    ("POST", "/pause_generation", {"mode": "stop"}),
    ("POST", "/pause_generation", {"mode": "retract", "not_a_field": 1}),
    ("POST", "/continue_generation", {}),
    ("POST", "/continue_generation", None),
    ("POST", "/abort_request", {"abort_all": True}),
    ("POST", "/abort_request", {"rid": 5}),
    ("POST", "/abort_request", {"rid": "no-such-request"}),
    ("POST", "/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"]}),
    ("POST", "/init_weights_update_group", {"master_address": "h", "master_port": "x", "rank_offset": 1,
                                            "world_size": 2}),
    ("POST", "/begin_weight_update", {"selector": "bogus"}),
    ("POST", "/end_weight_update", None),
    ("POST", "/destroy_weights_update_group", {"group_name": 5}),
    ("POST", "/update_weight_version", {"new_version": 1}),
    ("POST", "/update_weight_version", {"new_version": "7", "abort_all_requests": False}),
    ("POST", "/flush_cache?timeout=-1", None),
    ("GET", "/flush_cache?timeout=abc", None),
    ("GET", "/flush_cache", None),
    ("POST", "/flush_cache", {"timeout": 3}),
    ("GET", "/health", None),
    ("POST", "/health", {}),
    ("GET", "/health_generate", None),
    ("GET", "/get_model_info", None),
    ("POST", "/get_model_info", {}),
    ("GET", "/model_info", None),
    ("GET", "/server_info", None),
    ("PUT", "/generate", {"input_ids": [1, 2], "sampling_params": SP}),
    ("DELETE", "/generate", None),
    ("GET", "/no_such_route", None),
]


@pytest.mark.parametrize("i", range(len(CONTROL)))
def test_control_statuses_agree(sglang_http, cpu_server, i):
    method, path, body = CONTROL[i]
    want, why = sglang_http.request(method, path, body)
    got, text = _status(cpu_server, method, path, body)
    assert got == want, f"{method} {path} {body!r}: SGLang {want} ({why[:300]}), CPU server {got} ({text[:300]})"


LAX = [  # SGLang's control endpoints parse with pydantic's lax coercions; the CPU server's validation too
    ("POST /init_weights_update_group", "master_port", ["12", 12.0, 12.5, True, "12.0", " 12", None, [12], "x"]),
    ("POST /update_weights_from_distributed", "flush_cache", ["true", 1, 0, 2, "yes", "on", 1.0, None, "nope"]),
    ("POST /update_weights_from_distributed", "weight_version", [1, None, "3", 2.5]),
    ("POST /update_weights_from_distributed", "shapes", ["a", [1], [["2"]], [[2.0]], [[2.5]], [[True]]]),
    ("POST /destroy_weights_update_group", "group_name", [5, 5.0, None, True, "g"]),
    ("POST /pause_generation", "mode", ["in_place", "IN_PLACE", None, 1, "abort"]),
    ("POST /abort_request", "abort_all", ["false", 2, "1"]),
]
BASE = {"POST /init_weights_update_group": {"master_address": "h", "master_port": 12, "rank_offset": 1,
                                           "world_size": 2},
        "POST /update_weights_from_distributed": {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]]}}


@pytest.mark.parametrize("endpoint,field,values", LAX)
def test_request_parsing_agrees_value_by_value(sglang_http, endpoint, field, values):
    method, path = endpoint.split()
    for v in values:
        body = dict(BASE.get(endpoint, {}), **{field: v})
        want = sglang_http.request(method, path, body)[0]
        try:
            protocol.validate_request(endpoint, body, strict=False)
            got = 200
        except protocol.ProtocolError:
            got = 400
        assert got == want, f"{endpoint} {field}={v!r}: SGLang {want}, ours {got}"


def test_every_cpu_server_route_is_sglangs_with_the_same_methods(cpu_server, sglang_http):
    """Route by route: the CPU server answers exactly the methods SGLang's app has (405 otherwise)."""
    from m2po_megatron.rollout.local_server import LocalServer

    app = LocalServer.__new__(LocalServer).app()
    ours: dict[str, set] = {}
    for r in app.router.routes():
        ours.setdefault(r.resource.canonical, set()).add(r.method)
    for path, methods in ours.items():
        assert path in sglang_http.routes, f"the CPU server has {path}, SGLang 0.5.23 does not"
        assert methods - {"HEAD"} == sglang_http.routes[path] - {"HEAD"}, path
    assert json.loads(_http.request(f"{cpu_server.url}/get_server_info")[1])["context_length"] == CONTEXT
