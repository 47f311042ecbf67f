"""The recipe's reward, checked before anything starts (config validation): every term resolves and has the
shape of a reward function, the built-in terms' arguments are valid (the code reward's sandbox exists, a reward
service's URL and key variable are given), and the over-long buffer fits the response budget. Each message names
the recipe key and the fix."""
from __future__ import annotations

import math

from m2po_megatron.infra.plugins import PluginError

from .functions import REMOTE, load_reward_function, registered_rewards, resolve_target, term_key, terms_of

CODE_TARGET = "m2po_megatron.reward.code:code_reward"
MATH_TARGET = "m2po_megatron.reward.math_verify_reward:math_verify_fn"


def needs_label(reward_cfg) -> bool:
    """True when a term reads the row's label column (data.label_key): the built-in math_verify."""
    return any(t.target == MATH_TARGET for t in terms_of(reward_cfg))


def check_reward(cfg) -> list[str]:
    r = cfg.reward
    errors: list[str] = []
    if not math.isfinite(float(r.error_score)):
        errors.append(f"reward.error_score = {r.error_score} must be a finite number")
    terms = list(r.get("terms") or [])
    if terms and r.get("args"):
        errors.append("reward.args is set but reward.terms is given too, so reward.function and its args are unused; "
                      "move the arguments into the term (reward.terms[i].args)")
    for i, t in enumerate(terms_of(r)):
        key = term_key(i, r)
        if not t.spec:
            errors.append(f"{key}: no function; name a registered one ({', '.join(sorted(registered_rewards()))}), "
                          f"`package.module:name` or `path/to/file.py:name`")
            continue
        if not math.isfinite(t.weight):
            errors.append(f"{key}.weight = {t.weight} must be a finite number")
        if t.timeout_s is not None and not t.timeout_s > 0:
            errors.append(f"{key}.timeout_s = {t.timeout_s} must be > 0 (seconds per item), or null for "
                          f"reward.timeout_s")
        errors += _check_term(t, key)
        if t.target == CODE_TARGET:
            errors += _check_code_budget(t, key, float(r.timeout_s))
    b = r.overlong_buffer
    if b.enable:
        if not 0 < b.len <= cfg.rollout.max_new_tokens:
            errors.append(f"reward.overlong_buffer.len = {b.len} must be in (0, rollout.max_new_tokens = "
                          f"{cfg.rollout.max_new_tokens}]: the warning zone is the end of the response budget")
        if not b.penalty_factor >= 0:
            errors.append(f"reward.overlong_buffer.penalty_factor = {b.penalty_factor} must be >= 0")
    return errors


def _check_code_budget(t, key: str, pool_timeout_s: float) -> list[str]:
    """The pool's per-sample limit must leave room for at least one test case's own limit: a sample runs its
    cases one after the other, and a worker killed mid-sample scores it a timeout whatever the program did."""
    per_case = t.args.get("timeout_s", 5.0)
    limit = t.timeout_s or pool_timeout_s
    if isinstance(per_case, (int, float)) and limit <= per_case:
        where = f"{key}.timeout_s" if t.timeout_s else "reward.timeout_s"
        return [f"{where} = {limit:g} s is the time limit of a whole sample, but each of its test cases may run "
                f"{per_case:g} s (the code reward's args.timeout_s); raise {where} to cover the cases of a row "
                f"(e.g. {max(60, 4 * per_case):g})"]
    return []


def _check_term(t, key: str) -> list[str]:
    args_key = f"{key}.args" if key.startswith("reward.terms") else "reward.args"
    if t.target == REMOTE:
        from .remote import RemoteReward

        return [f"{args_key}: {e}" for e in RemoteReward.check_args(dict(t.args))]
    try:
        load_reward_function(resolve_target(t.spec), f"{key} = {t.spec!r}")
    except PluginError as e:
        return [str(e)]
    if t.target == CODE_TARGET:
        from .code import check_args

        return [f"{args_key}: {e}" for e in check_args(dict(t.args))]
    if t.target == MATH_TARGET:
        unknown = sorted(set(t.args) - {"label_key", "format_score"})
        if unknown:
            return [f"{args_key}: math_verify takes label_key and format_score, not {', '.join(unknown)}"]
    return []
