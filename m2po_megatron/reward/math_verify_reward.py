"""Rule-based math reward: math-verify on the last ``\\boxed{}`` of a response.

1.0 when math-verify says the boxed answer equals the gold answer, ``format_score`` when an answer was
extracted but is wrong (the paper's Appendix B uses 0.1, its released code 0), 0.0 when there is no answer.
math-verify's own time limits use SIGALRM, which only works on the main thread (its TimeoutException, not an
Exception subclass, scores 0 here); off the main thread `judge` scores in a worker process that is killed
past the limit. Training scores through :class:`RewardPool`, which kills and replaces stuck workers.
"""

from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import dataclass

from .extract import last_boxed

CORRECT, WRONG, NO_ANSWER, ERROR = "correct", "wrong", "no_answer", "error"


@dataclass(frozen=True)
class Verdict:
    score: float
    status: str  # one of CORRECT, WRONG, NO_ANSWER, ERROR
    extracted: str | None


def quiet_math_verify() -> None:
    # math-verify warns once per process when its own timeouts are off; the pool enforces them instead.
    logging.getLogger("math_verify").setLevel(logging.ERROR)


def _parse_answer(text: str, timeout: int | None):
    from math_verify import parse

    # raise_on_error=False: unparseable text gives [] (a wrong answer, not a crash)
    parsed = parse("\\boxed{" + text + "}", parsing_timeout=timeout)
    if not parsed:  # e.g. a gold answer already carrying $...$ delimiters
        parsed = parse(text, parsing_timeout=timeout)
    return parsed


def judge(response: str, answer: str, format_score: float = 0.0, timeout_s: int | None = 5) -> Verdict:
    """Score one response and say why. ``timeout_s`` is math-verify's own (main-thread) limit; None turns it
    off (required off the main thread, where the caller must bound time itself)."""
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError(f"answer must be a non-empty string, got {answer!r}; fix the dataset's 'answer' field")
    extracted = last_boxed(response or "")
    if extracted is None:
        return Verdict(0.0, NO_ANSWER, None)
    if threading.current_thread() is not threading.main_thread() and timeout_s is not None:
        # SIGALRM-based limits do not work here: score in a worker process the pool kills past the limit
        return _judge_in_worker(response, answer, format_score, timeout_s, extracted)
    from math_verify import verify
    from math_verify.errors import TimeoutException  # a BaseException: `except Exception` misses it

    try:
        gold = _parse_answer(answer.strip().strip("$"), timeout_s)
        if not gold:
            return Verdict(0.0, ERROR, extracted)  # the gold answer itself cannot be read: not the policy's fault
        pred = _parse_answer(extracted, timeout_s)
        ok = bool(pred) and verify(gold, pred, timeout_seconds=timeout_s, raise_on_error=True)
    except (Exception, TimeoutException):  # sympy failures, math-verify timeouts: it could not be checked
        return Verdict(0.0, ERROR, extracted)
    return Verdict(1.0, CORRECT, extracted) if ok else Verdict(float(format_score), WRONG, extracted)


_worker_pools: dict = {}  # format_score -> its RewardPool (the workers' arguments are fixed at start)
_worker_lock = threading.Lock()


def _judge_in_worker(response: str, answer: str, format_score: float, timeout_s: float, extracted: str) -> Verdict:
    """judge() off the main thread: one shared reward worker process (started on first use), killed and
    replaced when an item runs past timeout_s, which then scores 0 (status error)."""
    from .pool import MATH_VERIFY, RewardPool
    from .types import RewardInput

    with _worker_lock:
        pool = _worker_pools.get(float(format_score))
        if pool is None:
            pool = RewardPool([(MATH_VERIFY[0], {"format_score": float(format_score)})], num_workers=1,
                              timeout_s=float(timeout_s))
            _worker_pools[float(format_score)] = pool
            atexit.register(pool.close)
        pool.timeouts = [float(timeout_s)]
        (out,), _ = pool.score([RewardInput(response, [], {"answer": answer})])
    if out.score is None:
        return Verdict(0.0, ERROR, extracted)
    if out.extras.get("acc"):
        return Verdict(out.score, CORRECT, extracted)
    return Verdict(out.score, NO_ANSWER if out.extras.get("no_answer") else ERROR if out.extras.get("unverifiable")
                   else WRONG, extracted)


def math_verify_reward(response: str, answer: str, format_score: float = 0.0) -> float:
    """1.0 if the last ``\\boxed{}`` of ``response`` equals ``answer`` (math-verify), ``format_score`` if a boxed
    answer exists but is wrong, 0.0 if none (or if it could not be checked)."""
    return judge(response, answer, format_score).score


def math_verify_fn(response: str, token_ids: list[int], row: dict, *, label_key: str = "answer",
                   format_score: float = 0.0) -> dict:
    """The built-in `math_verify` reward term: `judge` against row[label_key]. Its extras: `acc` (1 when
    correct, verl's name) and `no_answer` (1 when there is no boxed answer); logged as reward/acc and
    reward/no_answer. Runs in a pool worker (no SIGALRM limits there: the pool bounds time)."""
    answer = row.get(label_key)
    if answer is None and "." in label_key:  # a nested column (verl's reward_model.ground_truth)
        answer = row
        for part in label_key.split("."):
            answer = answer.get(part) if isinstance(answer, dict) else None
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    v = judge(response, answer, format_score, timeout_s=None)
    return {"score": v.score, "acc": float(v.status == CORRECT), "no_answer": float(v.status == NO_ANSWER),
            "unverifiable": float(v.status == ERROR)}
