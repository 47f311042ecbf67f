"""A "verifier with feedback" rollout plug-in, written from docs/agents.md only.

Turn 1: the policy answers the row's prompt. The environment extracts the last \\boxed{...} of the
decoded policy text, compares it with ``row["answer"]`` and appends "\\nCorrect." or
"\\nWrong, try again:\\n" (mask 0). While wrong and turns remain (``ctx.args["max_turns"]``, default 2),
the policy answers again. The function scores the episode itself: 1.0 if the last answer is correct.

Malformed variants (for the drop-accounting test) are below the good one.
"""
from __future__ import annotations

import asyncio
import re
import zlib

from m2po_megatron.api import RolloutContext, RolloutResult, Trajectory

CORRECT = "\nCorrect."
WRONG = "\nWrong, try again:\n"


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in text (braces matched), else None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        i = start + len("\\boxed{")
        depth = 1
        j = i
        while j < len(text) and depth:
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
            j += 1
        if depth == 0:
            return text[i:j - 1].strip()
        start = text.rfind("\\boxed{", 0, start)      # unclosed: try an earlier one
    return None


def is_correct(text: str, answer) -> bool:
    got = last_boxed(text)
    if got is None:
        return False
    want = str(answer).strip()
    if got == want:
        return True
    try:
        return float(got) == float(want)
    except ValueError:
        return False


async def _episode(ctx: RolloutContext, i: int, correct_ids: list[int], wrong_ids: list[int]):
    max_turns = int(ctx.args.get("max_turns", 2)) if ctx.args else 2
    traj = Trajectory(ctx.prompt_ids)
    env_tokens = 0
    first_try_correct = None
    correct = False
    for turn in range(max_turns):
        if ctx.max_context and len(traj.context) >= ctx.max_context:
            break
        gens = await ctx.client.generate(traj.context, ctx.sampling_params,
                                         seed=ctx.seed + i + turn * ctx.n)
        gen = gens[0]
        traj.add_generation(gen)                          # mask 1, the engine's exact ids
        if gen.finish_reason == "abort":                  # pause_mode=abort: stop, the sample is dropped
            return traj.result()
        text = ctx.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        correct = is_correct(text, ctx.row["answer"])
        if first_try_correct is None:
            first_try_correct = correct
        feedback = correct_ids if correct else wrong_ids
        traj.add_environment(feedback)                    # mask 0, never trained on
        env_tokens += len(feedback)
        if correct:
            break
    res = traj.result(reward=1.0 if correct else 0.0,
                      metadata={"first_try_correct": bool(first_try_correct), "env_tokens": env_tokens})
    # Self-check of the mask rule: exactly the environment's tokens carry mask 0.
    masked = sum(1 for m in res.loss_mask if m == 0)
    ctx.log(turns=traj.turns, first_try_correct=float(bool(first_try_correct)),
            final_correct=float(correct), env_tokens=env_tokens,
            env_mask_ok=float(masked == env_tokens and len(res.loss_mask) == len(res.token_ids)))
    return res


def _feedback_ids(ctx: RolloutContext) -> tuple[list[int], list[int]]:
    enc = ctx.tokenizer.encode
    return enc(CORRECT, add_special_tokens=False), enc(WRONG, add_special_tokens=False)


async def feedback(ctx: RolloutContext) -> list[RolloutResult]:
    ok, bad = _feedback_ids(ctx)
    return list(await asyncio.gather(*(_episode(ctx, i, ok, bad) for i in range(ctx.n))))


# ---------------------------------------------------------------------------------------------------
# Malformed variants


async def bad_mask_len(ctx: RolloutContext) -> list[RolloutResult]:
    """Every result's loss mask is one entry short."""
    results = await feedback(ctx)
    for r in results:
        if r.finish_reason != "abort":
            r.loss_mask = list(r.loss_mask)[:-1]
    return results


async def some_none(ctx: RolloutContext) -> list[RolloutResult]:
    """Odd samples are rejected (None)."""
    results = await feedback(ctx)
    return [None if i % 2 else r for i, r in enumerate(results)]


async def no_versions(ctx: RolloutContext) -> list[RolloutResult]:
    """The results forget their versions."""
    results = await feedback(ctx)
    for r in results:
        r.versions = []
    return results


async def never_returns(ctx: RolloutContext) -> list[RolloutResult]:
    await asyncio.Event().wait()                          # sleeps forever; the run cancels it (timeout)
    raise AssertionError("unreachable")


async def raises(ctx: RolloutContext) -> list[RolloutResult]:
    raise RuntimeError("the environment crashed")


async def one_empty(ctx: RolloutContext) -> list[RolloutResult]:
    results = await feedback(ctx)
    results[0] = RolloutResult([], [], [], [])
    return results


async def short_logprobs(ctx: RolloutContext) -> list[RolloutResult]:
    results = await feedback(ctx)
    results[-1].logprobs = results[-1].logprobs[:-1]
    return results


# (raises, one_empty and short_logprobs were added by the project's engineers to cover every documented reason
# in one run; they too use only the page's names.)
VARIANTS = [feedback, bad_mask_len, some_none, no_versions, never_returns, raises, one_empty, short_logprobs]


def _group_index(group_id) -> int:
    """The page does not say what a group id is; in practice it is a string such as "g15"."""
    m = re.search(r"(\d+)$", str(group_id))
    return int(m.group(1)) if m else zlib.crc32(str(group_id).encode())


async def mixed(ctx: RolloutContext) -> list[RolloutResult]:
    """Switch between the good function and the malformed variants per group."""
    return await VARIANTS[_group_index(ctx.group_id) % len(VARIANTS)](ctx)


def not_async(ctx):
    """A plain (non-async) function: `m2po config` must refuse it."""
    return []
