"""The remote reward (reward/remote.py) against real HTTP services started here on 127.0.0.1 (port 0) that answer
right, need the API key, die mid-run, hang, answer garbage, or fail a few times first. Outcomes are read from
the verdicts, the client's stats() and the service's own counters (requests, items, bodies, requests in flight);
nothing depends on timing: each failure mode is decided by the service, and timeouts are small."""
from __future__ import annotations

import json
import logging
import re
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from m2po_megatron.reward.remote import RemoteReward
from m2po_megatron.reward.types import RewardInput

pytestmark = pytest.mark.timeout(60)

KEY_ENV = "M2PO_TEST_REWARD_SERVICE_KEY"


def item(i: int, label: str = "42") -> RewardInput:
    return RewardInput(response=f"my answer is #{i}", token_ids=[1, 2, i], row={"answer": label, "question": f"q{i}"},
                       prompt=f"<user>question {i}<assistant>")


def marker(text: str) -> float:
    """The score the fake reward model gives a text: the number after its last '#'."""
    return float(re.findall(r"#(\d+)", text)[-1])


class Service:
    """A reward service in threads of this process. HTTP/1.0: one connection per request, so a stopped service
    refuses the next one. `mode`: ok | hang (never answers until teardown) | die (on request `die_at` it stops
    listening and drops that request) | garbage (200 with `garbage` as the body) | fail (the first `fail_first`
    requests get `fail_status`, then ok). `gate`: hold each request until `gate` are in flight at once (or
    all `expected` requests came), so the in-flight counter shows the client's concurrency, not its speed;
    the first full wave is held until one request too many arrives, or at most 0.5 s (a bound on waiting for
    what a correct client never sends: the pass does not depend on it, only how surely a bad client fails)."""

    def __init__(self, key: str | None, mode: str = "ok", **kw):
        self.key, self.mode = key, mode
        self.die_at, self.garbage = kw.get("die_at"), kw.get("garbage")
        self.fail_first, self.fail_status = kw.get("fail_first", 0), kw.get("fail_status", 503)
        self.gate, self.expected = kw.get("gate"), kw.get("expected")
        self.cond = threading.Condition()
        self.requests: list[tuple[str, dict | None, str | None]] = []  # (path, body, Authorization header)
        self.in_flight = self.max_in_flight = 0
        self.release = threading.Event()
        self.window_started = self.window_over = False
        svc = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                svc.handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.stopped = False

    def stop(self) -> None:
        self.release.set()
        if not self.stopped:
            self.stopped = True
            self.server.shutdown()
            self.server.server_close()

    # -- one request -------------------------------------------------------------------------------------
    def handle(self, h: BaseHTTPRequestHandler) -> None:
        raw = h.rfile.read(int(h.headers.get("Content-Length", 0)))
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        auth = h.headers.get("Authorization")
        with self.cond:
            self.requests.append((h.path, body, auth))
            k = len(self.requests)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.cond.notify_all()
            if self.gate:  # the wait's limit only breaks a deadlock; the test then fails on max_in_flight
                self.cond.wait_for(lambda: self.in_flight >= self.gate or len(self.requests) >= self.expected,
                                   timeout=20)
                # The first full wave is held a while longer, waiting for one request too many: a client that
                # ignores its limit sends it at once, a correct one never does (passing takes no luck).
                if not self.window_started:
                    self.window_started = True
                    self.cond.wait_for(lambda: self.in_flight > self.gate, timeout=0.5)
                    self.window_over = True
                    self.cond.notify_all()
                else:
                    self.cond.wait_for(lambda: self.window_over, timeout=20)
        try:
            status, payload, headers = self.answer(k, h.path, body, auth)
        finally:
            with self.cond:  # done before the answer leaves: the client may send its next request at once
                self.in_flight -= 1
                self.cond.notify_all()
        if status is None:
            return  # the connection closes with no answer
        h.send_response(status)
        for name, value in {"Content-Type": "application/json", "Content-Length": str(len(payload)), **headers}.items():
            h.send_header(name, value)
        h.end_headers()
        h.wfile.write(payload)

    def answer(self, k: int, path: str, body, auth) -> tuple[int | None, bytes, dict]:
        if self.key and auth != f"Bearer {self.key}":  # a verbose service: it echoes what it got
            return 401, json.dumps({"error": "unauthorized", "got": auth}).encode(), {}
        if self.mode == "hang":
            self.release.wait()
            return None, b"", {}
        if self.mode == "die" and k == self.die_at:
            self.stop()  # no longer listening: later connections are refused
            return None, b"", {}
        if self.mode == "garbage":
            return 200, self.garbage, {}
        if self.mode == "fail" and k <= self.fail_first:
            return self.fail_status, json.dumps({"error": "busy", "got": auth}).encode(), {"Retry-After": "0"}
        if path == "/classify":  # SGLang's reward endpoint: one {"embedding": [score]} per text
            out = [{"embedding": [marker(t)], "meta_info": {"id": str(i)}} for i, t in enumerate(body["text"])]
        elif path == "/v1/chat/completions":
            content = body["messages"][-1]["content"]
            reply = f"Step 1 checks 2 things.\n{{\"score\": {marker(content)}}}"
            out = {"id": "x", "object": "chat.completion", "model": body.get("model", "default"),
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                                "finish_reason": "stop"}]}
        else:
            out = {"scores": [marker(it["response"]) for it in body["items"]]}
        return 200, json.dumps(out).encode(), {}


@pytest.fixture
def key(monkeypatch):
    k = "sk-" + secrets.token_hex(16)
    monkeypatch.setenv(KEY_ENV, k)
    return k


@pytest.fixture
def service(key):
    made = []

    def make(mode: str = "ok", **kw) -> Service:
        made.append(Service(key, mode, **kw))
        return made[-1]

    yield make
    for s in made:
        s.stop()


def client(url: str, **kw) -> RemoteReward:
    args = {"url": url, "kind": "http", "api_key_env": KEY_ENV, "timeout_s": 5.0, "max_retries": 2,
            "backoff_s": 0.01, "max_backoff_s": 0.05, **kw}
    return RemoteReward(args)


def test_http_kind_scores_in_order_in_batches_of_at_most_batch_size(service):
    svc = service()
    with client(svc.url + "/score", batch_size=3) as rm:
        outs = rm.score([item(i) for i in range(10)])
        stats = rm.stats()
    assert [o.score for o in outs] == [float(i) for i in range(10)]
    assert all(o.status == "ok" for o in outs)
    sizes = [len(body["items"]) for _, body, _ in svc.requests]
    assert sorted(sizes) == [1, 3, 3, 3]
    first = svc.requests[0][1]["items"][0]
    assert set(first) == {"prompt", "response", "label", "row", "finish_reason"} and first["label"] == "42"
    assert stats["items"] == 10 and stats["scored"] == 10 and stats["failed"] == 0
    assert stats["requests"] == 4 and stats["retries"] == 0 and stats["seconds"] > 0
    assert rm.score([]) == []


@pytest.mark.parametrize("threads", [1, 2])
def test_never_more_requests_in_flight_than_max_concurrency(service, threads):
    """The service holds each request until 3 are in flight, so it sees the most the client ever sends at once;
    two threads scoring at once share the limit."""
    per_thread = 10
    svc = service(gate=3, expected=threads * per_thread // 2)
    rm = client(svc.url, batch_size=2, max_concurrency=3)
    results = {}

    def work(t):
        results[t] = rm.score([item(100 * t + i) for i in range(per_thread)])

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    rm.close()
    assert svc.max_in_flight == 3
    for t, outs in results.items():
        assert [o.score for o in outs] == [float(100 * t + i) for i in range(per_thread)]
    assert len(svc.requests) == threads * per_thread // 2


def test_sglang_rm_posts_texts_to_classify_and_reads_the_embedding(service):
    svc = service()
    with client(svc.url, kind="sglang_rm", rm_template="Q: {prompt}\nA: {response}", batch_size=4,
                score_scale=0.5, max_score=2.0) as rm:
        outs = rm.score([item(i) for i in range(6)])
    assert [o.score for o in outs] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.0]  # scaled, then clamped
    paths = {p for p, _, _ in svc.requests}
    assert paths == {"/classify"}
    # the two batches go out concurrently, so in either order: the one of items 0-3 starts with item 0
    body = next(b for _, b, _ in svc.requests if len(b["text"]) == 4)
    assert set(body) == {"text"} and body["text"][0] == "Q: <user>question 0<assistant>\nA: my answer is #0"


def test_openai_judge_sends_one_chat_completion_per_item(service):
    svc = service()
    with client(svc.url + "/v1", kind="openai_judge", model="judge-7b", judge_system="Be strict.",
                judge_template="Task: {prompt}\nGold: {label}\nAnswer: {response}", prompt_key="question",
                max_tokens=64) as rm:
        outs = rm.score([item(i, label=f"L{i}") for i in range(4)])
        stats = rm.stats()
    assert [o.score for o in outs] == [0.0, 1.0, 2.0, 3.0]
    assert stats["requests"] == 4
    path, body, _ = svc.requests[0]
    assert path == "/v1/chat/completions"
    i = int(marker(body["messages"][1]["content"]))
    assert body["model"] == "judge-7b" and body["max_completion_tokens"] == 64 and body["temperature"] == 0.0
    assert body["messages"][0] == {"role": "system", "content": "Be strict."}
    assert body["messages"][1] == {"role": "user", "content": f"Task: q{i}\nGold: L{i}\nAnswer: my answer is #{i}"}


def test_the_key_is_required_and_never_shown(service, key, monkeypatch, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    svc = service()
    monkeypatch.setenv("M2PO_TEST_WRONG_KEY", "sk-wrong-" + secrets.token_hex(8))
    wrong = client(svc.url, api_key_env="M2PO_TEST_WRONG_KEY", batch_size=2)
    missing = client(svc.url, api_key_env=None, batch_size=2)
    right = client(svc.url, batch_size=2)
    texts = []
    for rm, ok in ((wrong, False), (missing, False), (right, True)):
        outs = rm.score([item(i) for i in range(4)])
        stats = rm.stats()
        texts += [repr(stats)] + [f"{o.status} {o.detail}" for o in outs]
        if ok:
            assert [o.score for o in outs] == [0.0, 1.0, 2.0, 3.0]
        else:  # a refused key is not retried: one request per batch
            assert all(o.score is None and o.status == "http_401" for o in outs)
            assert stats["failed/http_401"] == 4 and stats["requests"] == 2 and stats["retries"] == 0
        rm.close()
    assert [a for _, _, a in svc.requests][-2:] == [f"Bearer {key}"] * 2  # sent, as a bearer header
    failing = service("fail", fail_first=100, fail_status=500)  # it echoes the right key in its error
    with client(failing.url, max_retries=0) as rm:
        outs = rm.score([item(0)])
        texts += [repr(rm.stats())] + [f"{o.status} {o.detail}" for o in outs]
    assert outs[0].status == "http_500" and "Bearer ***" in outs[0].detail  # the key cut out of its message
    with pytest.raises(ValueError) as e:  # a key written into the recipe is refused without echoing it
        RemoteReward({"url": svc.url, "kind": "http", "api_key": key})
    texts.append(str(e.value))
    out, err = capfd.readouterr()
    for text in (*texts, caplog.text, out, err):
        assert key not in text
    assert "http_401" in caplog.text  # the failure itself is logged


def test_a_service_that_dies_mid_run_fails_the_rest_as_connection_errors(service):
    svc = service("die", die_at=3)
    with client(svc.url, batch_size=2, max_concurrency=1, max_retries=1) as rm:
        outs = rm.score([item(i) for i in range(10)])
        stats = rm.stats()
    assert [o.score for o in outs[:4]] == [0.0, 1.0, 2.0, 3.0]  # batches 1 and 2, before it died
    assert all(o.score is None and o.status == "connection" for o in outs[4:])
    assert stats["failed/connection"] == 6 and stats["scored"] == 4
    assert stats["requests"] == 2 + 3 * 2 and stats["retries"] == 3 and stats["retried/connection"] == 3
    assert len(svc.requests) == 3  # nothing reached it after it stopped


def test_a_service_that_never_answers_times_out(service):
    svc = service("hang")
    with client(svc.url, batch_size=2, max_concurrency=4, timeout_s=0.2, max_retries=1) as rm:
        outs = rm.score([item(i) for i in range(6)])
        stats = rm.stats()
    assert all(o.score is None and o.status == "timeout" for o in outs)
    assert stats["failed/timeout"] == 6 and stats["requests"] == 6 and stats["retried/timeout"] == 3
    assert len(svc.requests) == 6


@pytest.mark.parametrize("kind,garbage,scores", [
    ("http", b"<html>Internal error</html>", [None, None, None]),
    ("http", b'{"result": [1, 2, 3]}', [None, None, None]),
    ("http", b'{"scores": [1.0, 2.0]}', [None, None, None]),  # two scores for three items
    ("http", b'{"scores": [NaN, 1.5, Infinity]}', [None, 1.5, None]),
    ("http", b'{"scores": [null, "1.0", true]}', [None, None, None]),
    ("http", b'{"scores": [{"score": 1.0, "len": 3}, {"len": 3}, {"score": 2.0, "bad": NaN}]}', [1.0, None, None]),
    ("sglang_rm", b'[{"embedding": [0.5]}, {"embedding": []}, {"meta_info": {}}]', [0.5, None, None]),
    ("sglang_rm", b'{"embedding": [0.5]}', [None, None, None]),
    ("openai_judge", b'{"choices": [{"message": {"content": "I would rather not say."}}]}', [None, None, None]),
    ("openai_judge", b'{"choices": [{"message": {"content": null}, "finish_reason": "length"}]}', [None] * 3),
    ("openai_judge", b'{"choices": []}', [None, None, None]),
])
def test_garbage_answers_are_bad_responses_and_not_retried(service, kind, garbage, scores):
    svc = service("garbage", garbage=garbage)
    with client(svc.url, kind=kind) as rm:
        outs = rm.score([item(i) for i in range(3)])
        stats = rm.stats()
    assert [o.score for o in outs] == scores
    bad = scores.count(None)
    assert [o.status for o in outs].count("bad_response") == bad
    assert stats.get("failed/bad_response", 0) == bad and stats["scored"] == 3 - bad
    assert stats["retries"] == 0 and stats["requests"] == len(svc.requests) == (3 if kind == "openai_judge" else 1)
    if kind == "http" and scores[0] == 1.0:
        assert outs[0].extras == {"len": 3.0}


@pytest.mark.parametrize("status", [503, 429, 500])
def test_transient_failures_are_retried_and_succeed(service, status):
    svc = service("fail", fail_first=2, fail_status=status)
    with client(svc.url, max_retries=3) as rm:
        outs = rm.score([item(i) for i in range(3)])
        stats = rm.stats()
        assert rm.stats()["requests"] == 0  # counters are since the previous call
    assert [o.score for o in outs] == [0.0, 1.0, 2.0]
    assert stats["requests"] == 3 and stats["retries"] == 2 and stats[f"retried/http_{status}"] == 2
    assert stats["failed"] == 0


def test_other_client_errors_and_exhausted_retries_fail_with_the_status(service):
    svc = service("fail", fail_first=100, fail_status=400)
    with client(svc.url) as rm:
        outs = rm.score([item(i) for i in range(2)])
        assert all(o.status == "http_400" and "busy" in o.detail for o in outs)
        assert rm.stats()["requests"] == 1
    svc = service("fail", fail_first=100, fail_status=502)
    with client(svc.url, max_retries=2) as rm:
        outs = rm.score([item(i) for i in range(2)])
        stats = rm.stats()
    assert all(o.status == "http_502" for o in outs)
    assert stats["requests"] == 3 and stats["failed/http_502"] == 2


def test_args_are_checked_with_the_field_and_the_fix(monkeypatch):
    monkeypatch.delenv("M2PO_TEST_UNSET_KEY", raising=False)
    check = RemoteReward.check_args
    assert check({"url": "http://127.0.0.1:1/score", "kind": "http"}) == []
    cases = [
        ({"kind": "http"}, "args.url: required"),
        ({"url": "ftp://h", "kind": "http"}, "args.url: must be http(s)"),
        ({"url": "http://user:pw@h", "kind": "http"}, "args.url: carries a user name or password"),
        ({"url": "http://h"}, "args.kind: required"),
        ({"url": "http://h", "kind": "grpc"}, "args.kind: 'grpc' is not a kind"),
        ({"url": "http://h", "kind": "http", "batch_size": 0}, "args.batch_size = 0: must be an integer >= 1"),
        ({"url": "http://h", "kind": "http", "max_retries": -1}, "args.max_retries"),
        ({"url": "http://h", "kind": "http", "timeout_s": 0}, "args.timeout_s"),
        ({"url": "http://h", "kind": "http", "backoff_s": 2, "max_backoff_s": 1}, "args.max_backoff_s"),
        ({"url": "http://h", "kind": "http", "model": "m"}, "args.model: used only by kind openai_judge"),
        ({"url": "http://h", "kind": "openai_judge", "batch_size": 4}, "args.batch_size: used only by kind"),
        ({"url": "http://h", "kind": "openai_judge", "judge_template": "{prompt} {answer}"}, "uses {answer}"),
        ({"url": "http://h", "kind": "openai_judge", "judge_template": "{prompt}"}, "has no {response}"),
        ({"url": "http://h", "kind": "sglang_rm", "rm_template": "{} {response}"}, "positional field"),
        ({"url": "http://h", "kind": "http", "api_key_env": "M2PO_TEST_UNSET_KEY"}, "M2PO_TEST_UNSET_KEY is not set"),
        ({"url": "http://h", "kind": "http", "api_key_env": "sk-abc123"}, "the NAME of an environment variable"),
        ({"url": "http://h", "kind": "http", "min_score": 1, "max_score": 0}, "args.min_score = 1 > args.max_score"),
        ({"url": "http://h", "kind": "http", "retries": 3}, "args.retries: unknown"),
        ({"url": "http://h", "kind": "openai_judge", "extra_body": {"messages": []}}, "args.extra_body: sets messages"),
    ]
    for args, want in cases:
        errors = check(args)
        assert any(want in e for e in errors), (args, errors)
    assert "sk-abc123" not in " ".join(check({"url": "http://h", "kind": "http", "api_key_env": "sk-abc123"}))
    with pytest.raises(ValueError, match="args.url"):
        RemoteReward({"kind": "http"})


def test_a_closed_client_refuses_and_close_is_idempotent(service):
    svc = service()
    rm = client(svc.url)
    assert rm.score([item(1)])[0].score == 1.0
    rm.close()
    rm.close()
    with pytest.raises(RuntimeError, match="closed"):
        rm.score([item(1)])
