"""Resolving a recipe's plug-in names (rollout.function, eval.function, rollout.tool_call_parser) to objects,
and checking them before anything starts: a registered name, `package.module:name` or `path/to/file.py:name`
(a user need not install a package)."""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path
from typing import Callable, Optional

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


class PluginError(ValueError):
    """A plug-in name that cannot be used; the message names the recipe key and the fix."""


def _user_path(ref: str) -> Path:
    """As config.paths resolves a recipe's paths: as given (absolute, or from the working directory), else
    from the repository root (a checkout's own files, e.g. tests/agents/plugins.py)."""
    p = Path(os.path.expandvars(os.path.expanduser(ref)))
    if p.is_absolute() or p.exists():
        return p
    in_repo = Path(__file__).resolve().parents[2] / p
    return in_repo if in_repo.exists() else p


def _import_file(path: Path, key: str):
    if not path.is_file():
        raise PluginError(f"{key}: no file {path} (a relative path is taken from the working directory "
                          f"{Path.cwd()}); give an existing .py file or a `package.module:name`")
    # one module per file, under a name derived from its absolute path, so two plug-ins named alike coexist
    name = f"m2po_plugin_{path.stem}_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise PluginError(f"{key}: importing {path} failed: {type(e).__name__}: {e}") from e
    return module


def resolve_object(spec: str, key: str, registry: Optional[dict] = None):
    """The object a plug-in name names (registered names first)."""
    if not isinstance(spec, str) or not spec.strip():
        raise PluginError(f"{key} must be a non-empty string: a registered name "
                          f"({', '.join(sorted(registry or {})) or 'none'}), `package.module:name` or "
                          f"`path/to/file.py:name`")
    spec = spec.strip()
    if registry and spec in registry:
        spec = registry[spec]
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        known = f"; registered names: {', '.join(sorted(registry))}" if registry else ""
        raise PluginError(f"{key} = {spec!r} is neither a registered name nor `package.module:name` / "
                          f"`path/to/file.py:name`{known}")
    if target.endswith(".py"):
        module = _import_file(_user_path(target), key)
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:  # ImportError, or the module's own error while importing
            raise PluginError(f"{key} = {spec!r}: importing {target} failed: {type(e).__name__}: {e}; check the "
                              f"module is on PYTHONPATH (or name its file: `path/to/file.py:{attr}`)") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise PluginError(f"{key} = {spec!r}: {target} has no attribute {attr!r}; its callables: "
                          f"{', '.join(names[:12]) or 'none'}") from None


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
