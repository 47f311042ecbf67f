"""DAPO's soft over-long punishment (verl's reward_model.overlong_buffer), as pure arithmetic.

A response may use `max_tokens` tokens. The last `buffer` of them are a warning zone: a response that ends
inside it loses reward in proportion to how far in it got, up to `factor` at the very end. Shorter responses
are not touched, so the penalty shapes length without changing which answers are right."""
from __future__ import annotations


def overlong_penalty(length: int, max_tokens: int, buffer: int, factor: float) -> float:
    """A number <= 0 to add to the reward of a response of `length` tokens."""
    if buffer <= 0:
        return 0.0
    safe = max_tokens - buffer  # responses up to here cost nothing
    over = length - safe
    if over <= 0:
        return 0.0
    return -min(over, buffer) / buffer * factor
