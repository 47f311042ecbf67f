"""Verifiable math rewards (math-verify on the last ``\\boxed{}``), serial and in a process pool."""

from .extract import last_boxed
from .math_verify_reward import Verdict, judge, math_verify_reward
from .pool import RewardPool, RewardStats

__all__ = ["last_boxed", "judge", "Verdict", "math_verify_reward", "RewardPool", "RewardStats"]
