"""Colocation's engine side on the CPU server, over real HTTP from another process: release and resume of
memory by SGLang's tags, the update from serialized tensors (shared memory by name), and every refusal.
One server process serves the module."""
import base64
import json
import pickle

import pytest
import torch

from m2po_megatron.rollout import _http
from m2po_megatron.rollout.memory_occupation import (KV, TAGS_ALL, WEIGHTS, release_memory, resume_memory,
                                                     serialize_named_tensors, update_weights_from_tensor)
from tests.rollout.conftest import hf_logprobs, local_server

KEY = "colocate-key"
PROMPT = [5, 6, 7, 8]
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with local_server(tiny_model_dir, tmp_path_factory.mktemp("logs"), api_key=KEY, random_seed=0,
                      enable_deterministic_inference=True, context_length=128) as proc:
        yield proc.url


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _post(url, path, body):
    status, text = _http.request(f"{url}{path}", body, api_key=KEY)
    return status, json.loads(text) if text.strip() else None


def _generate(url):
    return _post(url, "/generate", {"input_ids": PROMPT, "return_logprob": True,
                                    "sampling_params": {"max_new_tokens": 6, "temperature": 1.0}})


def _logprobs(out):
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])


def _update(url, named, version):
    update_weights_from_tensor(url, KEY, [serialize_named_tensors(named)], version, 60)


def test_full_swap_loads_the_new_weights(server, hf_model):
    status, before = _generate(server)
    assert status == 200
    release_memory(server, KEY, TAGS_ALL, 60)
    status, out = _generate(server)
    assert status == 400 and all(t in out["error"]["message"] for t in TAGS_ALL), out
    assert _http.request(f"{server}/health_generate", api_key=KEY)[0] == 503
    assert _http.request(f"{server}/health")[0] == 200  # as SGLang's /health: no generation behind it
    with pytest.raises(RuntimeError, match="already released"):
        release_memory(server, KEY, WEIGHTS, 60)
    resume_memory(server, KEY, WEIGHTS, 60)
    # the trainer's new weights: the model's own, perturbed (copies: pickling moves them to shared memory)
    torch.manual_seed(1)
    new = [(n, p.detach() + 0.05 * torch.randn_like(p)) for n, p in hf_model.named_parameters()]
    _update(server, new, "7")
    status, out = _generate(server)
    assert status == 400 and "kv_cache" in out["error"]["message"] and "weights" not in out["error"]["message"]
    resume_memory(server, KEY, KV, 60)
    status, after = _generate(server)
    assert status == 200 and after["meta_info"]["weight_version"] == "7"
    orig = [p.detach().clone() for p in hf_model.parameters()]
    try:
        with torch.no_grad():
            for (_, t), p in zip(new, hf_model.parameters()):
                p.copy_(t)
        ref = hf_logprobs(hf_model, PROMPT, after["output_ids"])
        assert (ref - _logprobs(after)).abs().max() <= 1e-5  # the new weights generated it
    finally:
        with torch.no_grad():  # the module's model stays as loaded
            for o, p in zip(orig, hf_model.parameters()):
                p.copy_(o)
    assert before["meta_info"]["weight_version"] != "7"


def test_resumed_weights_without_update_refuse_generation(server, hf_model):
    release_memory(server, KEY, WEIGHTS, 60)
    resume_memory(server, KEY, WEIGHTS, 60)
    status, out = _generate(server)
    assert status == 400 and "NaN" in out["error"]["message"], out
    names = [n for n, _ in hf_model.named_parameters()]
    _update(server, [(n, p.detach().clone()) for n, p in list(hf_model.named_parameters())[:-1]], "8")
    status, out = _generate(server)  # one parameter still missing: named
    assert status == 400 and names[-1] in out["error"]["message"], out
    _update(server, [(names[-1], list(hf_model.parameters())[-1].detach().clone())], "9")
    status, out = _generate(server)
    assert status == 200 and out["meta_info"]["weight_version"] == "9"


def test_bad_updates_and_tags_are_refused_with_clear_errors(server, hf_model):
    name, p = next(iter(hf_model.named_parameters()))
    with pytest.raises(RuntimeError, match="no_such.weight"):
        _update(server, [("no_such.weight", torch.zeros(2))], "x")
    with pytest.raises(RuntimeError, match=rf"{name}.*shape"):
        _update(server, [(name, torch.zeros(3, 3))], "x")

    class Evil:
        def __reduce__(self):
            return (exec, ("open('/tmp/m2po-pwned', 'w')",))

    evil = base64.b64encode(pickle.dumps([(name, Evil())])).decode()
    with pytest.raises(RuntimeError, match="refused global builtins.exec"):
        update_weights_from_tensor(server, KEY, [evil], "x", 60)
    with pytest.raises(RuntimeError, match="not base64"):
        update_weights_from_tensor(server, KEY, ["%%%"], "x", 60)
    # outside a session (SGLang 0.5.23's rule), and the session was closed after each failure above
    status, out = _post(server, "/update_weights_from_tensor",
                        {"serialized_named_tensors": [serialize_named_tensors([(name, p.detach().clone())])]})
    assert status == 400 and "begin_weight_update()" in out["message"]
    with pytest.raises(RuntimeError, match=r"not released"):
        resume_memory(server, KEY, KV, 60)
    status, out = _post(server, "/release_memory_occupation", {"tags": ["weight"]})
    assert status == 400 and "unknown tag" in out["error"]["message"]
    assert _post(server, "/release_memory_occupation", {"tags": None})[0] == 200  # null = all, as SGLang
    assert _post(server, "/resume_memory_occupation", {})[0] == 200  # no tags = all
    status, out = _generate(server)  # resumed without an update: NaN weights refused
    assert status == 400 and "NaN" in out["error"]["message"]
    _update(server, [(n, q.detach().clone()) for n, q in hf_model.named_parameters()], "10")
    assert _generate(server)[0] == 200
    assert _http.request(f"{server}/release_memory_occupation", {"tags": None})[0] == 401  # behind the API key


def test_release_while_a_request_runs_is_refused(server):
    """SGLang asserts an idle engine (its scheduler fails); here: HTTP 400, and the request is unharmed. A
    request is paused in place once seen in the engine (it stays there, running); one that ended before it was
    seen is replaced by another, so the outcome never depends on how fast the engine decodes."""
    import threading

    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}}
    for _attempt in range(50):
        box = {}
        t = threading.Thread(target=lambda: box.update(r=_post(server, "/generate", body)), daemon=True)
        t.start()
        seen = False
        while t.is_alive() and not seen:
            state = _post(server, "/get_server_info", None)[1]["internal_states"][0]
            seen = bool(state["running"] or state["waiting"])
        if seen:
            assert _post(server, "/pause_generation", {"mode": "in_place"})[0] == 200
            state = _post(server, "/get_server_info", None)[1]["internal_states"][0]
            if state["running"] or state["waiting"]:
                break
            assert _post(server, "/continue_generation", {})[0] == 200  # it ended just before the pause
        t.join(60)
    else:
        raise AssertionError("no request was caught in the engine in 50 tries")
    try:
        status, out = _post(server, "/release_memory_occupation", {"tags": list(TAGS_ALL)})
        assert status == 400 and "idle" in out["error"]["message"], out
    finally:
        assert _post(server, "/continue_generation", {})[0] == 200
    t.join(60)
    assert box["r"][0] == 200 and len(box["r"][1]["output_ids"]) == 100
