"""Reward functions as a user writes them (the contract in m2po_megatron/reward/types.py), loaded by the tests
as `tests/reward/reward_plugins.py:<name>`: no import from the package needed."""
import asyncio
import math
import time


def length_reward(response, token_ids, row, *, target=4):
    """Closer to `target` tokens is better: 1 at the target, falling off linearly."""
    return max(0.0, 1.0 - abs(len(token_ids) - target) / target)


async def keyword_reward(response, token_ids, row, **args):
    await asyncio.sleep(0)  # an async function is awaited on the worker's loop
    hit = row["keyword"] in response
    return {"score": float(hit), "hit": hit, "chars": len(response)}


def raises(response, token_ids, row):
    raise KeyError("no such column")


def returns_nan(response, token_ids, row):
    return math.nan


def returns_bool(response, token_ids, row):
    return True


def returns_dict_without_score(response, token_ids, row):
    return {"value": 1.0}


def slow_when_asked(response, token_ids, row):
    if "slow" in response:
        time.sleep(60)  # the pool's per-item limit kills the worker
    return 1.0


def two_args(response, token_ids):
    return 0.0


NOT_CALLABLE = 3
