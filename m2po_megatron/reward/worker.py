"""Reward worker process, started by :class:`m2po_megatron.reward.RewardPool`.

Protocol (JSON lines): the first line on stdin is ``{"functions": [[target, args], ...]}``; the worker imports
each (reward/functions.py), answers ``"ready"`` or ``["failed", message]``, then reads items
``[idx, function_index, response, token_ids, row]`` and writes ``[idx, score_or_null, extras, status, detail]``.
It holds no time limit of its own: the pool kills it when an item runs too long.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import sys


def _call(fn, loop, response, token_ids, row, args):
    out = fn(response, token_ids, row, **args)
    if inspect.isawaitable(out):  # an async reward function: awaited on the worker's own loop
        out = loop.run_until_complete(out)
    return out


def main() -> int:
    # A stop signal sent to every process of a Slurm step is for the driver, which checkpoints and then
    # closes our stdin; scoring continues until then.
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr  # stray prints from reward functions must not corrupt the protocol stream
    from .functions import load_reward_function
    from .math_verify_reward import quiet_math_verify
    from .types import RewardValueError, normalize

    quiet_math_verify()
    header = sys.stdin.readline()
    try:
        specs = json.loads(header)["functions"]
        fns = [load_reward_function(target, target) for target, _ in specs]
        args = [dict(a) for _, a in specs]
    except Exception as exc:  # noqa: BLE001 - the pool reports it and stops the run before training
        out.write(json.dumps(["failed", f"{type(exc).__name__}: {exc}"]) + "\n")
        return 1
    loop = asyncio.new_event_loop()
    if any(target.endswith(":math_verify_fn") for target, _ in specs):
        from .math_verify_reward import judge

        judge("\\boxed{1}", "1", 0.0, timeout_s=None)  # import sympy & friends before saying ready
    out.write('"ready"\n')
    for line in sys.stdin:
        if not line.strip():
            continue
        idx, fi, response, token_ids, row = json.loads(line)
        try:
            score, extras = normalize(_call(fns[fi], loop, response, token_ids, row, args[fi]))
            out.write(json.dumps([idx, score, extras, "ok", ""]) + "\n")
        except RewardValueError as exc:
            out.write(json.dumps([idx, None, {}, "bad_value", str(exc)[:300]]) + "\n")
        except Exception as exc:  # noqa: BLE001 - a reward function's own failure: counted, the worker serves on
            out.write(json.dumps([idx, None, {}, "error", f"{type(exc).__name__}: {exc}"[:300]]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
