"""Checks shared by the staleness pieces: ids and counts that go into JSON checkpoints."""
from __future__ import annotations

from typing import Any, Union

GroupId = Union[int, str]
SampleId = Union[int, str]


def check_id(kind: str, x: Any) -> None:
    # ids go into JSON checkpoints: keep them to ints and strings (bool is an int, but surely a bug).
    if isinstance(x, bool) or not isinstance(x, (int, str)):
        raise TypeError(f"{kind} id {x!r} has type {type(x).__name__}; ids must be int or str")


def nonneg_int(name: str, x: Any, minimum: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < minimum:
        raise ValueError(f"{name} = {x!r}: must be an integer >= {minimum}")
    return x
