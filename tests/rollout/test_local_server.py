"""The CPU server over real HTTP: log-probs equal the trainer's, protocol refusals, auth, pause, and weight
sync over gloo (retract and in_place pauses, inside the weight-update session). One server process serves the whole module (start ~10-40 s)."""
import asyncio
import json
import socket
import time

import pytest
import torch

from m2po_megatron.rollout import _http
from m2po_megatron.rollout.client import RolloutClient, SyncRolloutClient
from m2po_megatron.convert.export import hf_buckets
from m2po_megatron.rollout.weight_sync import DistributedWeightSync
from tests.rollout.conftest import hf_logprobs, local_server

KEY = "test-secret-key"
CONTEXT = 700  # --context-length of the module's server
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with local_server(tiny_model_dir, tmp_path_factory.mktemp("logs"), api_key=KEY, random_seed=0,
                      enable_deterministic_inference=True, context_length=CONTEXT) as proc:
        yield proc


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def run(coro):
    return asyncio.run(coro)


async def _gen_many(url, prompts, sp, n):
    async with RolloutClient([url], api_key=KEY) as c:
        return await asyncio.gather(*(c.generate(p, sp, n=n) for p in prompts)), c.stats


def test_logprobs_equal_trainer_logprobs_under_concurrency(server, hf_model):
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16], [3], [20, 21, 22, 23]]
    results, stats = run(_gen_many(server.url, prompts, {"temperature": 1.0, "max_new_tokens": 12}, n=3))
    assert stats.completed == 12 and stats.reissued == 0
    worst = 0.0
    for prompt, samples in zip(prompts, results):
        assert len(samples) == 3
        for s in samples:
            assert len(s.output_ids) == len(s.output_logprobs) == len(s.token_versions) > 0
            assert s.prompt_tokens == len(prompt) and s.finish_reason in ("stop", "length")
            ref = hf_logprobs(hf_model, prompt, s.output_ids)
            worst = max(worst, (ref - torch.tensor(s.output_logprobs)).abs().max().item())
    assert worst <= 1e-5


def test_logprobs_under_temperature_are_of_the_scaled_distribution(server, hf_model):
    (samples,), _ = run(_gen_many(server.url, [[4, 5]], {"temperature": 0.5, "top_k": 20, "max_new_tokens": 6}, 1))
    s = samples[0]
    ids = torch.tensor([[4, 5] + s.output_ids])
    with torch.no_grad():
        lp = torch.log_softmax(hf_model(ids).logits[0] / 0.5, -1)
    ref = lp[1:-1].gather(-1, torch.tensor(s.output_ids)[:, None])[:, 0]
    assert (ref - torch.tensor(s.output_logprobs)).abs().max() <= 1e-5


def test_seed_reproducible_and_stop_token(server):
    url = server.url
    sp = {"temperature": 1.0, "max_new_tokens": 10, "sampling_seed": 123, "ignore_eos": True}
    (a,), _ = run(_gen_many(url, [[7, 8, 9]], sp, 2))
    (b,), _ = run(_gen_many(url, [[7, 8, 9]], sp, 2))
    assert [x.output_ids for x in a] == [x.output_ids for x in b]
    assert a[0].output_ids != a[1].output_ids  # sample i uses seed + i
    stop = a[0].output_ids[4]
    first = a[0].output_ids.index(stop)
    (c,), _ = run(_gen_many(url, [[7, 8, 9]], dict(sp, stop_token_ids=[stop]), 1))
    assert c[0].finish_reason == "stop" and c[0].meta_info["finish_reason"]["matched"] == stop
    assert c[0].output_ids == a[0].output_ids[:first + 1]
    assert a[0].finish_reason == "length" and len(a[0].output_ids) == 10


def test_server_side_n_and_batch(server):
    body = {"input_ids": [[5, 6], [7]], "sampling_params": {"max_new_tokens": 3, "n": 2}, "return_logprob": True}
    status, text = _http.request(f"{server.url}/generate", body, api_key=KEY)
    out = json.loads(text)
    assert status == 200 and len(out) == 4
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 2, 1, 1]
    assert all(len(o["meta_info"]["output_token_logprobs"]) == o["meta_info"]["completion_tokens"] for o in out)


@pytest.mark.parametrize("body,needle", [
    ({"input_ids": [1, 2], "sampling_params": {"max_tokens": 3}}, "max_tokens"),
    ({"text": "hello"}, "not supported"),
    ({"input_ids": [1, 99999]}, "outside the vocabulary"),
    ({"input_ids": [1, 2], "sampling_params": {"min_new_tokens": 1}}, "skip_tokenizer_init"),
    ({"input_ids": [1, 2], "sampling_params": {"stop": ""}}, "skip_tokenizer_init"),
    ({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": CONTEXT - 2}}, "Requested token count"),
    ({"input_ids": [1] * CONTEXT, "sampling_params": {"max_new_tokens": 1}}, "longer than the model"),
    ({"input_ids": [1] * (CONTEXT - 6), "sampling_params": {"max_new_tokens": 1}}, "Input length"),
])
def test_bad_requests_are_refused_with_400(server, body, needle):
    status, text = _http.request(f"{server.url}/generate", body, api_key=KEY)
    assert status == 400 and needle in text, text


def test_what_sglang_accepts_is_accepted(server):
    """Unknown top-level fields are ignored, an empty stop list is no stop string, and a request that fills
    the context exactly is served; SGLang never generates into the context's last 2 positions."""
    body = {"input_ids": [5, 6, 7], "no_such_field": {"x": 1}, "return_logprob": True,
            "sampling_params": {"max_new_tokens": CONTEXT - 3, "ignore_eos": True, "stop": [], "sampling_seed": 1}}
    status, text = _http.request(f"{server.url}/generate", body, api_key=KEY)
    assert status == 200, text
    out = json.loads(text)
    assert len(out["output_ids"]) == CONTEXT - 3 - 2 and out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["weight_versions"][-1]["end"] == CONTEXT - 5


def test_flush_cache_takes_a_query_and_is_refused_while_requests_run(server):
    assert _http.request(f"{server.url}/flush_cache?timeout=-1", api_key=KEY)[0] == 400
    assert _http.request(f"{server.url}/flush_cache", api_key=KEY)[0] == 200
    assert _http.request(f"{server.url}/flush_cache", {"timeout": "ignored body"}, api_key=KEY)[0] == 200
    client = SyncRolloutClient([server.url], api_key=KEY)
    try:
        fut = _submit_and_freeze(client, server.url, [5, 6], max_new_tokens=500)
        status, text = _http.request(f"{server.url}/flush_cache", api_key=KEY)
        assert status == 400, text  # a request is running (frozen in place)
        client.continue_generation()
        fut.result(180)
        assert _http.request(f"{server.url}/flush_cache?timeout=30", api_key=KEY)[0] == 200
    finally:
        client.continue_generation()
        client.close()


def test_api_key_required_and_never_echoed(server):
    status, _ = _http.request(f"{server.url}/generate", {"input_ids": [1]})
    assert status == 401
    status, _ = _http.request(f"{server.url}/generate", {"input_ids": [1]}, api_key="wrong")
    assert status == 401
    assert _http.request(f"{server.url}/health")[0] == 200  # health stays open, as in SGLang
    status, text = _http.request(f"{server.url}/get_server_info", api_key=KEY)
    assert status == 200 and KEY not in text and json.loads(text)["host"] == "127.0.0.1"
    assert KEY not in open(server.log_path).read()
    status, text = _http.request(f"{server.url}/get_model_info", api_key=KEY)
    assert json.loads(text)["is_generation"] is True


def test_control_http_statuses_timeouts_and_refusals(server):
    """The synchronous control-plane helper (launcher health checks, weight-sync calls) against the real
    server: statuses come back as values, 401 without the key, post_ok raises with the server's text, a
    server that holds the request past the timeout raises TimeoutError, a closed port ConnectionError."""
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
    assert _http.request(f"{server.url}/generate", body)[0] == 401
    with pytest.raises(RuntimeError, match="answered 401"):
        _http.post_ok(f"{server.url}/generate", body)
    with pytest.raises(RuntimeError, match="answered 400.*max_tokens"):
        _http.post_ok(f"{server.url}/generate", {"input_ids": [1], "sampling_params": {"max_tokens": 2}},
                      api_key=KEY)
    assert len(_http.post_ok(f"{server.url}/generate", body, api_key=KEY)["output_ids"]) == 2
    _http.post_ok(f"{server.url}/pause_generation", {"mode": "in_place"}, api_key=KEY)
    try:  # a paused server holds /generate until continue_generation: no answer can come in time
        with pytest.raises(TimeoutError, match="no answer within 0.5 s"):
            _http.request(f"{server.url}/generate", body, api_key=KEY, timeout=0.5)
    finally:
        _http.post_ok(f"{server.url}/continue_generation", {}, api_key=KEY)
    # the abandoned request still runs once continued (as in SGLang): let it finish before the next test
    _wait_state(server.url, lambda s: s["held_by_pause"] == s["waiting"] == s["running"] == 0)
    with socket.socket() as s:  # bound, not listening: connections to it are refused
        s.bind(("127.0.0.1", 0))
        with pytest.raises(ConnectionError):
            _http.request(f"http://127.0.0.1:{s.getsockname()[1]}/health", timeout=30)
    with pytest.raises(ValueError):
        _http.request("no-scheme/health")


def test_pause_in_place_holds_requests_and_abort_mode_aborts(server):
    client = SyncRolloutClient([server.url], api_key=KEY)
    try:
        client.pause("in_place")
        fut = client.submit([5, 6], {"max_new_tokens": 4}, n=1)
        state = _wait_state(server.url, lambda s: s["held_by_pause"] == 1)
        assert state["paused"] and state["waiting"] == state["running"] == 0  # held before the engine
        assert not fut.done()
        client.continue_generation()
        assert len(fut.result(60)[0].output_ids) >= 1
        fut = _submit_and_freeze(client, server.url, [5, 6], max_new_tokens=500)
        client.pause("abort")  # aborts the frozen running sample (a second pause changes the mode)
        s = fut.result(60)[0]
        assert s.finish_reason == "abort" and len(s.output_ids) < 500
        assert client.stats.aborted == 1
    finally:
        client.continue_generation()
        client.close()


def _wait_state(url, ready, timeout=240, gone=lambda: False):
    """Poll the server's scheduler state (get_server_info's internal_states) until ready(state), or until
    gone() says the awaited state can no longer come (None then). The timeout is generous: a loaded CI
    machine starts requests slowly."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = json.loads(_http.request(f"{url}/get_server_info", api_key=KEY)[1])["internal_states"][0]
        if ready(state):
            return state
        if gone():
            return None
        time.sleep(0.05)
    raise TimeoutError(f"the server never reached the awaited state; last {state}")


def _wait_running(url, fut=None):
    """Until a request runs; or until `fut` is answered, since a short sample can start and finish between two
    polls (_submit_and_freeze then tries again; a caller that only needs the request done goes on)."""
    _wait_state(url, lambda s: s["running"] > 0, gone=lambda: fut is not None and fut.done())


def _submit_and_freeze(client, url, prompt, max_new_tokens=600, attempts=3):
    """Submit one long sample and freeze it mid-decode (pause in_place) so a sync lands inside it for sure.
    A running sequence has sampled at least one token; on a slow machine the sample could finish before the
    pause arrives, so try again then (the test checks the spans, not timing)."""
    for _ in range(attempts):
        fut = client.submit(prompt, {"max_new_tokens": max_new_tokens, "ignore_eos": True}, n=1)
        _wait_running(url, fut)
        client.pause("in_place")
        info = json.loads(_http.request(f"{url}/get_server_info", api_key=KEY)[1])["internal_states"][0]
        if info["running"] == 1 and not fut.done():
            return fut
        client.continue_generation()
        fut.result(180)
    raise AssertionError(f"a {max_new_tokens}-token sample finished before pause_generation {attempts} times")


def _perturbed_state(model, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + scale * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()]


def _load(model, named):
    with torch.no_grad():
        params = dict(model.named_parameters())
        for n, t in named:
            params[n].copy_(t)


def test_weight_sync_retract_then_in_place_then_retract(server, hf_model):
    sync = DistributedWeightSync([server.url], api_key=KEY, backend="gloo", timeout_s=120)
    sync.init_group()
    try:
        # 1) paused sync: the served log-probs equal the trainer's at the new weights, version is the new one
        new = _perturbed_state(hf_model, 0.05, seed=1)
        stats = sync.sync(hf_buckets(new, bucket_bytes=20_000), weight_version=1)
        assert stats["num_buckets"] > 1 and stats["num_tensors"] == len(new) and stats["gb_per_s"] > 0
        with torch.no_grad():
            for n, t in new:
                dict(hf_model.named_parameters())[n].copy_(t)
        (samples,), _ = run(_gen_many(server.url, [[5, 6, 7]], {"max_new_tokens": 12}, 2))
        for s in samples:
            assert s.token_versions == [1] * len(s.output_ids) and s.weight_version == 1
            assert (hf_logprobs(hf_model, [5, 6, 7], s.output_ids) - torch.tensor(s.output_logprobs)).abs().max() <= 1e-5

        # 2) a sync with pause_mode in_place while a long sample decodes: the sample keeps its KV cache and
        # continues with the new weights; its spans say which tokens came from which version
        v1_state = {n: p.detach().clone() for n, p in hf_model.named_parameters()}
        client = SyncRolloutClient([server.url], api_key=KEY)
        try:
            fut = _submit_and_freeze(client, server.url, [9, 8, 7])
            v2 = _perturbed_state(hf_model, 0.05, seed=2)
            sync.pause_mode = "in_place"
            sync.sync(hf_buckets(v2), weight_version=2)  # no cache flush: SGLang refuses it while requests run
            s = fut.result(180)[0]
        finally:
            client.continue_generation()
            client.close()
        spans = s.meta_info["weight_versions"]
        assert [sp["version"] for sp in spans] == ["1", "2"] and spans[0]["start"] == 0
        assert spans[-1]["end"] == len(s.output_ids) and s.weight_version == 2
        cut = spans[0]["end"]
        assert 0 < cut < len(s.output_ids)
        assert s.token_versions == [1] * cut + [2] * (len(s.output_ids) - cut)
        # tokens of the first span were produced by the v1 weights exactly
        with torch.no_grad():
            for n, p in hf_model.named_parameters():
                p.copy_(v1_state[n])
        ref = hf_logprobs(hf_model, [9, 8, 7], s.output_ids[:cut])
        assert (ref - torch.tensor(s.output_logprobs[:cut])).abs().max() <= 1e-5

        # 3) paused sync with retract while a sample decodes: after continue its KV is recomputed with the new
        # weights, so every later token's log-prob equals a full forward at the new weights
        _load(hf_model, v2)
        sync.pause_mode = "retract"
        client = SyncRolloutClient([server.url], api_key=KEY)
        try:
            fut = _submit_and_freeze(client, server.url, [4, 4, 2])
            v3 = _perturbed_state(hf_model, 0.05, seed=3)
            sync.sync(hf_buckets(v3), weight_version=3)  # its retract pause re-queues the frozen sample; continues
            s = fut.result(180)[0]
        finally:
            client.continue_generation()
            client.close()
        spans = s.meta_info["weight_versions"]
        assert [sp["version"] for sp in spans] == ["2", "3"] and spans[-1]["end"] == len(s.output_ids) == 600
        cut = spans[0]["end"]
        ref_v2 = hf_logprobs(hf_model, [4, 4, 2], s.output_ids[:cut])
        assert (ref_v2 - torch.tensor(s.output_logprobs[:cut])).abs().max() <= 1e-5
        _load(hf_model, v3)
        ref_v3 = hf_logprobs(hf_model, [4, 4, 2], s.output_ids)[cut:]
        assert (ref_v3 - torch.tensor(s.output_logprobs[cut:])).abs().max() <= 1e-5
    finally:
        sync.close()


def _post(url, path, body):
    status, text = _http.request(f"{url}{path}", body, api_key=KEY)
    return status, json.loads(text)


def test_updates_need_the_weight_update_session(server, hf_model):
    """As SGLang 0.5.23: an update outside begin/end is refused at once and never joins the broadcast (the
    answer comes back although nobody broadcasts); begin twice or end without begin are refused."""
    sync = DistributedWeightSync([server.url], api_key=KEY, backend="gloo", timeout_s=120,
                                 group_name="session_test_group")
    sync.init_group()
    try:
        body = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[4]], "group_name": sync.group_name}
        status, out = _post(server.url, "/update_weights_from_distributed", body)
        assert status == 400 and out["success"] is False and "begin_weight_update()" in out["message"]
        status, out = _post(server.url, "/update_weights_from_tensor", {"serialized_named_tensors": ["AA=="]})
        assert status == 400 and "begin_weight_update()" in out["message"]
        assert _post(server.url, "/end_weight_update", {})[0] == 400
        assert _post(server.url, "/begin_weight_update", {})[0] == 200
        status, out = _post(server.url, "/begin_weight_update", {"selector": "all"})
        assert status == 400 and "already open" in out["message"]
        assert _post(server.url, "/end_weight_update", {})[0] == 200
        # a sync that forgets the session fails fast, naming the reason, instead of hanging in the broadcast
        sync._begin_session = lambda: None
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="begin_weight_update"):
            sync.sync(hf_buckets(hf_model.named_parameters()), weight_version=99)
        assert time.monotonic() - t0 < sync.timeout_s and sync.broken
        info = json.loads(_http.request(f"{server.url}/get_model_info", api_key=KEY)[1])
        assert info["weight_version"] != "99"
    finally:
        sync.close()


def test_update_outside_a_pause_waits_for_running_requests(server):
    """SGLang 0.5.23 has no in-flight update: every /generate holds the model-update lock, so an update that
    is not paused waits until the running request finished, and no sample changes version mid-sequence."""
    client = SyncRolloutClient([server.url], api_key=KEY)
    try:
        fut = client.submit([3, 4], {"max_new_tokens": 400, "ignore_eos": True}, n=1)
        _wait_running(server.url, fut)
        status, _ = _post(server.url, "/begin_weight_update", {})
        state = json.loads(_http.request(f"{server.url}/get_server_info", api_key=KEY)[1])["internal_states"][0]
        assert status == 200 and state["running"] == 0  # begin could only return after the sample finished
        s = fut.result(60)[0]
        assert len(s.output_ids) == 400 and len(set(s.token_versions)) == 1
        status, out = _post(server.url, "/update_weight_version", {"new_version": "42", "abort_all_requests": False})
        assert status == 200 and out["new_version"] == "42"
        assert _post(server.url, "/end_weight_update", {})[0] == 200
    finally:
        client.close()


def test_health_waits_while_paused_as_sglangs_does(tiny_model_dir, tmp_path, monkeypatch):
    """SGLang's health check generates one token, which waits while generation is paused: 503 after
    SGLANG_HEALTH_CHECK_TIMEOUT seconds (1 here), 200 again once generation continues."""
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")
    with local_server(tiny_model_dir, tmp_path) as proc:
        assert _http.request(f"{proc.url}/pause_generation", {"mode": "retract"})[0] == 200
        assert _http.request(f"{proc.url}/health")[0] == 503
        assert _http.request(f"{proc.url}/health_generate")[0] == 503
        assert _http.request(f"{proc.url}/continue_generation", {})[0] == 200
        assert _http.request(f"{proc.url}/health_generate")[0] == 200
