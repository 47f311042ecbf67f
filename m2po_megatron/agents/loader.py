"""Resolving a recipe's plug-in names (rollout.function, eval.function, rollout.tool_call_parser) to objects,
and checking them before anything starts: a registered name, `package.module:name` or `path/to/file.py:name`
(a user need not install a package)."""
from __future__ import annotations

import inspect
from typing import Callable, Optional

from m2po_megatron.infra.plugins import PluginError, resolve_object

__all__ = ["PluginError", "resolve_object", "register_rollout", "registered_rollouts", "load_rollout_function",
           "check_rollout_signature", "load_tool_parser", "check_plugins"]

DEFAULT_ROLLOUT = "single_turn"
ROLLOUTS: dict[str, str] = {}  # name -> "module:function" (registered names resolve before import paths)


def register_rollout(name: str, target: str) -> None:
    """Let recipes say `rollout.function: name` for the import path `target` ("package.module:function")."""
    ROLLOUTS[name] = target


def registered_rollouts() -> dict[str, str]:
    return dict(ROLLOUTS)


register_rollout(DEFAULT_ROLLOUT, "m2po_megatron.agents.single_turn:rollout")
register_rollout("calculator", "m2po_megatron.examples.calculator:rollout")
register_rollout("calculator_http", "m2po_megatron.examples.http_env:rollout")


def load_rollout_function(spec: Optional[str], key: str = "rollout.function") -> tuple[Callable, str]:
    """(the async rollout function, its display name) or PluginError naming `key` and the fix."""
    spec = spec or DEFAULT_ROLLOUT
    fn = resolve_object(spec, key, registered_rollouts())
    check_rollout_signature(fn, spec, key)
    return fn, spec


def check_rollout_signature(fn, spec: str, key: str) -> None:
    """An `async def f(ctx)` (or an object whose __call__ is one): called with one RolloutContext."""
    call = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else getattr(fn, "__call__", None)
    if call is None or not callable(fn):
        raise PluginError(f"{key} = {spec!r} is a {type(fn).__name__}, not a function; name an "
                          f"`async def rollout(ctx: RolloutContext) -> list[RolloutResult]`")
    if not inspect.iscoroutinefunction(call):
        raise PluginError(f"{key} = {spec!r} is not an async function; declare it `async def ...(ctx)` "
                          f"(it is awaited once per prompt group; see docs/agents.md)")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(required) > 1 or required and required[0].kind == required[0].KEYWORD_ONLY or not (positional or varargs):
        raise PluginError(f"{key} = {spec!r} has the signature {sig}; it must take exactly one argument, the "
                          f"RolloutContext: `async def ...(ctx)`")


def load_tool_parser(name: Optional[str], key: str = "rollout.tool_call_parser"):
    if not name:
        return None
    from m2po_megatron.agents.tools import make_tool_parser

    try:
        return make_tool_parser(name)
    except (ValueError, ImportError) as e:
        raise PluginError(f"{key} = {name!r}: {e}") from e


def check_plugins(cfg, errors: list[str]) -> None:
    """The recipe's plug-ins import and have the right shape (config validation; nothing runs)."""
    r = cfg.rollout
    for key, spec in (("rollout.function", r.get("function")), ("eval.function", cfg.eval.get("function"))):
        if key == "eval.function" and spec is None:
            continue  # the run's rollout.function
        try:
            load_rollout_function(spec, key)
        except PluginError as e:
            errors.append(str(e))
    try:
        load_tool_parser(r.get("tool_call_parser"))
    except PluginError as e:
        errors.append(str(e))
    if r.get("function_timeout_s") is not None and r.function_timeout_s <= 0:
        errors.append(f"rollout.function_timeout_s = {r.function_timeout_s} must be > 0 (seconds per prompt "
                      "group's call), or null for no limit")
