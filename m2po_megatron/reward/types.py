"""What a reward function is given and what it may return: the one contract every reward term follows
(built-in math_verify and code, a user's `reward.function`, the remote reward service).

A reward function is called as ``fn(response, token_ids, row, **args)``:
- ``response``: the decoded text of the policy's tokens (special tokens skipped);
- ``token_ids``: those tokens (a multi-turn episode's environment tokens are not the policy's answer);
- ``row``: the data row with every field it has in the file (data.label_key's value among them);
- ``args``: the term's keyword arguments from the recipe (reward.args, or reward.terms[i].args).

It returns a finite float, or a dict with a finite ``score`` and other finite numbers, each logged as
``reward/<key>`` (its mean over the step's scored samples). It may be ``async def``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Awaitable, Optional, Protocol, Union

RewardValue = Union[float, dict]


class RewardFunction(Protocol):
    """``fn(response, token_ids, row, **args) -> float | dict`` (or an ``async def`` returning one)."""

    def __call__(self, response: str, token_ids: list[int], row: dict,
                 **args: Any) -> Union[RewardValue, Awaitable[RewardValue]]: ...


@dataclass
class RewardInput:
    """One sample to score."""
    response: str
    token_ids: list[int]
    row: dict
    prompt: str = ""  # the prompt text the model saw, as rendered (a reward model or judge reads it)
    finish_reason: str = "stop"


@dataclass
class RewardOutput:
    """One term's verdict on one sample. ``score`` is None when the term failed (``status`` says why: timeout,
    error, bad_value, service_failed, ...); the recipe's reward.on_error then scores or drops the sample."""
    score: Optional[float]
    extras: dict[str, float] = field(default_factory=dict)
    status: str = "ok"
    detail: str = ""  # a failure's message (printed once per term and kind by compose.Rewards, never with the row)


class RewardValueError(ValueError):
    """A reward function returned something that is not a finite float or a dict with a finite `score`."""


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def normalize(value: Any) -> tuple[float, dict[str, float]]:
    """(score, extras) of a reward function's return value; RewardValueError names what is wrong."""
    if _finite(value):
        return float(value), {}
    if isinstance(value, float):
        raise RewardValueError(f"returned {value}, not a finite number")
    if isinstance(value, bool):  # a bool is an int to Python; a reward of True is almost surely a mistake
        raise RewardValueError(f"returned a bool ({value}); return a float (e.g. float(ok)) or a dict")
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardValueError(f"returned a dict without 'score' (keys: {sorted(value)[:8]})")
        if not _finite(value["score"]):  # a bool score is refused as a bare bool is
            raise RewardValueError(f"returned score = {value['score']!r}, not a finite number")
        extras = {}
        for k, v in value.items():
            if k == "score":
                continue
            if not isinstance(k, str) or not k or "/" in k:
                raise RewardValueError(f"returned an extra key {k!r}; keys are names without '/'")
            if isinstance(v, bool):
                v = float(v)
            if not _finite(v):
                raise RewardValueError(f"returned {k} = {v!r}; extra values must be finite numbers")
            extras[k] = float(v)
        return float(value["score"]), extras
    raise RewardValueError(f"returned {type(value).__name__} ({str(value)[:60]!r}); return a float or a dict "
                           f"with a 'score'")
