"""Real training runs whose reward is a faulty reward service (reward.function=remote, kind http) started here on
127.0.0.1 with an API key: it hangs on some prompts' groups, answers garbage for one sample of others, or dies
mid-run, all in one run. The run goes on: with reward.on_error=drop the failed samples are dropped as
reward_error (reward.on_error=score, which scores them reward.error_score instead, is the same composer's other
branch: tests/reward/test_reward_terms.py); every step's sample accounting adds up and the client's failure
counters are logged as reward/remote/*. The key is in no output of the run."""
from __future__ import annotations

import json
import math
import secrets

import pytest

from tests.loop.test_train_runs import RUN_TIMEOUT, assert_accounting, m2po, ok, overrides, steps
from tests.reward.test_remote_reward import Service

KEY_ENV = "M2PO_TEST_REMOTE_RM_KEY"


def row_class(row: dict) -> int:
    """0: the service hangs, 1: it answers NaN for the batch's first sample, 2: it answers right."""
    tail = str(row.get("id", "")).rsplit("/", 1)[-1]
    return int(tail) % 3 if tail.isdigit() else 2


class FlakyService(Service):
    """The `http` kind's protocol, decided per request by its first sample's row (a batch is one group: batch_size
    = rollout.n_samples_per_prompt); it stops listening at request `die_at`, or at the first request after that
    once it has met every behaviour: which rows come first depends on the pace of generation (a loaded machine
    once sent 9 requests of hanging and NaN rows only)."""

    def __init__(self, key: str, die_at: int):
        super().__init__(key, die_at=die_at)
        self.met: set[int] = set()
        self.died_at: int | None = None

    def answer(self, k, path, body, auth):
        if auth != f"Bearer {self.key}":
            return 401, b'{"error": "unauthorized"}', {}
        cls = row_class(body["items"][0]["row"])
        if k >= self.die_at and self.met >= {0, 1, 2}:
            self.died_at = k
            self.stop()
            return None, b"", {}
        self.met.add(cls)
        if cls == 0:
            self.release.wait()  # until the test ends: the client's timeout decides
            return None, b"", {}
        scores = [float(str(it["label"]) in it["response"]) for it in body["items"]]
        if cls == 1:
            scores[0] = math.nan
        return 200, json.dumps({"scores": scores}).encode(), {}


def run(tiny_task, tmp_path, name: str, url: str, on_error: str, key: str) -> list[dict]:
    args = (f'{{url: "{url}/score", kind: http, api_key_env: {KEY_ENV}, batch_size: 4, max_concurrency: 8, '
            f'timeout_s: 1.0, max_retries: 1, backoff_s: 0.05, max_backoff_s: 0.2}}')
    p = m2po("train", "tiny-cpu", *overrides(tiny_task, tmp_path, name, "reward.function=remote",
                                             f"reward.args={args}", f"reward.on_error={on_error}", "train.steps=2"))
    ok(p)
    assert key not in p.stdout + p.stderr
    for f in (tmp_path / name).rglob("*"):  # config, metrics, logs, trace: the key is nowhere
        if f.is_file() and f.stat().st_size < 50_000_000:
            assert key not in f.read_bytes().decode(errors="replace"), f
    rows = steps(tmp_path / name)
    assert [r["step"] for r in rows] == [1, 2]
    assert_accounting(rows)
    return rows


def total(rows: list[dict], key: str) -> float:
    return sum(r.get(key, 0) for r in rows)


@pytest.fixture
def key(monkeypatch):
    k = "sk-" + secrets.token_hex(16)
    monkeypatch.setenv(KEY_ENV, k)  # the run inherits it; the recipe names only the variable
    return k


@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_a_faulty_reward_service_drops_failures_and_the_run_goes_on(tiny_task, tmp_path, key):
    flaky = FlakyService(key, die_at=9)  # 2 steps of 4 groups, some re-sent: it dies during the second step
    try:
        rows = run(tiny_task, tmp_path, "drop", flaky.url, "drop", key)
    finally:
        flaky.stop()
    assert total(rows, "samples/dropped/reward_error") > 0
    assert total(rows, "reward/remote/failed/timeout") > 0 and total(rows, "reward/remote/failed/bad_response") > 0
    assert total(rows, "reward/remote/failed/connection") > 0  # after it died
    assert total(rows, "reward/remote/scored") > 0 and total(rows, "reward/remote/retried/timeout") > 0
    classes = {row_class(b["items"][0]["row"]) for _, b, _ in flaky.requests if b}
    assert classes == {0, 1, 2}, classes  # every behaviour was met
    # it died at its ninth request or, still missing a behaviour, later; nothing reached it after
    assert flaky.died_at is not None and flaky.died_at >= 9 and len(flaky.requests) == flaky.died_at
