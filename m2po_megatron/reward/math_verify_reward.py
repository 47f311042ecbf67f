"""Rule-based math reward: math-verify on the last ``\\boxed{}`` of a response.

1.0 when math-verify says the boxed answer equals the gold answer, ``format_score`` when an answer was
extracted but is wrong (the paper's Appendix B uses 0.1, its released code 0), 0.0 when there is no answer.
math-verify's own time limits use SIGALRM, which only works on the main thread and cannot interrupt a long
C-level computation (e.g. ``9^{9^{9^9}}``); training should score through :class:`RewardPool`, which
kills and replaces stuck worker processes.
"""

from __future__ import annotations

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


def _quiet_math_verify() -> None:
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
    if threading.current_thread() is not threading.main_thread():
        timeout_s = None  # SIGALRM-based limits raise ValueError off the main thread
    from math_verify import verify

    try:
        gold = _parse_answer(answer.strip().strip("$"), timeout_s)
        if not gold:
            return Verdict(0.0, ERROR, extracted)  # the gold answer itself cannot be read: not the policy's fault
        pred = _parse_answer(extracted, timeout_s)
        ok = bool(pred) and verify(gold, pred, timeout_seconds=timeout_s, raise_on_error=True)
    except Exception:  # sympy failures and math-verify timeouts inside verify: the answer could not be checked
        return Verdict(0.0, ERROR, extracted)
    return Verdict(1.0, CORRECT, extracted) if ok else Verdict(float(format_score), WRONG, extracted)


def math_verify_reward(response: str, answer: str, format_score: float = 0.0) -> float:
    """1.0 if the last ``\\boxed{}`` of ``response`` equals ``answer`` (math-verify), ``format_score`` if a boxed
    answer exists but is wrong, 0.0 if none (or if it could not be checked)."""
    return judge(response, answer, format_score).score
