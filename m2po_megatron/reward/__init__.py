"""Rewards: the reward-function contract (types.py), its registry (functions.py), the killable worker pool
(pool.py), the recipe's weighted terms (compose.py), and the built-in functions: math-verify on the last
``\\boxed{}``, the sandboxed `code` reward, a reward service over HTTP (remote.py)."""

from .compose import Rewards, Scored, rewards_from_config
from .extract import last_boxed
from .math_verify_reward import Verdict, judge, math_verify_fn, math_verify_reward
from .pool import RewardPool, RewardStats
from .types import RewardInput, RewardOutput

__all__ = ["last_boxed", "judge", "Verdict", "math_verify_reward", "math_verify_fn", "RewardPool", "RewardStats",
           "RewardInput", "RewardOutput", "Rewards", "Scored", "rewards_from_config"]
