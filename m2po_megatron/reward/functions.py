"""The reward registry (verl's reward-function registry, slime's --custom-rm-path): a recipe's
`reward.function` or `reward.terms[i].function` is a registered name, `package.module:name` or
`path/to/file.py:name`. Names resolve here, in the driver, before anything starts; the worker processes import
the resolved `module:name` / absolute `file.py:name`, so a relative path means the same thing everywhere."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from m2po_megatron.infra.plugins import PluginError, resolve_object, user_path

REMOTE = "remote"  # a reward service over HTTP (reward/remote.py): scored in batches by the driver, not the pool
REWARD_FUNCTIONS: dict[str, str] = {}  # name -> "module:function"


def register_reward(name: str, target: str) -> None:
    """Let recipes say `reward.function: name` for the import path `target` ("package.module:function")."""
    REWARD_FUNCTIONS[name] = target


def registered_rewards() -> dict[str, str]:
    return {**REWARD_FUNCTIONS, REMOTE: "m2po_megatron.reward.remote:RemoteReward"}


register_reward("math_verify", "m2po_megatron.reward.math_verify_reward:math_verify_fn")
register_reward("code", "m2po_megatron.reward.code:code_reward")


@dataclass
class Term:
    """One weighted reward term, resolved: what the workers import (`target`) and how it is logged (`name`)."""
    spec: str  # as the recipe wrote it
    target: str  # "module:name" or "/abs/path/file.py:name"; REMOTE for a reward service
    weight: float = 1.0
    args: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    timeout_s: Optional[float] = None

    @property
    def remote(self) -> bool:
        return self.target == REMOTE


def resolve_target(spec: str) -> str:
    """The import path a worker process can use for `spec` (registered names and relative files resolved)."""
    spec = spec.strip()
    target = REWARD_FUNCTIONS.get(spec, spec)
    if spec == REMOTE:
        return REMOTE
    mod, sep, attr = target.rpartition(":")
    if sep and mod.endswith(".py"):
        return f"{user_path(mod).resolve()}:{attr}"
    return target


def load_reward_function(target: str, key: str) -> Callable:
    """The callable `target` names, checked to take (response, token_ids, row, **args); PluginError otherwise."""
    fn = resolve_object(target, key, None)
    if not callable(fn):
        raise PluginError(f"{key}: {target} is a {type(fn).__name__}, not a function; name a "
                          f"`def reward(response, token_ids, row, **args) -> float | dict`")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    required = [p for p in positional if p.default is p.empty]
    if (len(positional) < 3 and not varargs) or len(required) > 3:
        raise PluginError(f"{key}: {target} has the signature {sig}; a reward function is called as "
                          f"fn(response, token_ids, row, **args)")
    return fn


def terms_of(reward_cfg) -> list[Term]:
    """The recipe's reward terms: reward.terms when given, else reward.function (+ reward.args) with weight 1."""
    raw = list(reward_cfg.get("terms") or [])
    if not raw:
        raw = [{"function": reward_cfg.get("function") or "math_verify", "weight": 1.0,
                "args": dict(reward_cfg.get("args") or {}), "name": None}]
    terms, names = [], set()
    for t in raw:
        spec = str(t.get("function") or "")
        name = t.get("name") or _default_name(spec)
        while name in names:  # two terms of the same function get distinct metric names
            name += "_"
        names.add(name)
        terms.append(Term(spec=spec, target=resolve_target(spec) if spec else spec, weight=float(t.get("weight", 1.0)),
                          args=dict(t.get("args") or {}), name=name, timeout_s=t.get("timeout_s")))
    return terms


def _default_name(spec: str) -> str:
    attr = spec.rpartition(":")[2] or spec
    return attr.strip() or "reward"


def term_key(i: int, reward_cfg) -> str:
    return f"reward.terms[{i}]" if reward_cfg.get("terms") else "reward.function"
