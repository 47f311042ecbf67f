"""Reward worker process: reads JSON lines ``[idx, response, answer, format_score]`` on stdin and writes
``[idx, score, status]`` on stdout. Started by :class:`m2po_megatron.reward.RewardPool`; it holds no time
limit of its own (the pool kills it when an item runs too long)."""

from __future__ import annotations

import json
import os
import signal
import sys


def main() -> int:
    # A stop signal sent to every process of a Slurm step is for the driver, which checkpoints and then
    # closes our stdin; scoring continues until then.
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr  # stray prints from libraries must not corrupt the protocol stream
    from .math_verify_reward import _quiet_math_verify, judge

    _quiet_math_verify()
    judge("\\boxed{1}", "1", 0.0, timeout_s=None)  # import sympy & friends before saying ready
    out.write('"ready"\n')
    for line in sys.stdin:
        if not line.strip():
            continue
        idx, response, answer, format_score = json.loads(line)
        try:
            v = judge(response, answer, format_score, timeout_s=None)
            out.write(json.dumps([idx, v.score, v.status]) + "\n")
        except Exception as exc:  # bad input (e.g. empty gold): report, keep serving
            out.write(json.dumps([idx, 0.0, "error", f"{type(exc).__name__}: {exc}"]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
