"""Resolving a recipe's plug-in names to objects: a registered name, `package.module:name` or
`path/to/file.py:name` (a user need not install a package). Used by rollout functions (agents/loader.py) and
reward functions (reward/functions.py) alike."""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Optional


class PluginError(ValueError):
    """A plug-in name that cannot be used; the message names the recipe key and the fix."""


def user_path(ref: str) -> Path:
    """The file of a `path/to/file.py:name` plug-in: `~` and $VARs expanded, relative to the working directory.
    A recipe's own plug-in paths arrive absolute: the config loader resolves them against the recipe file
    (config/paths.py), so this only decides for names given on the command line or in code."""
    return Path(os.path.expandvars(os.path.expanduser(ref)))


def import_file(path: Path, key: str):
    if not path.is_file():
        where = ("" if path.is_absolute() else f" (from the working directory {Path.cwd()})")
        raise PluginError(f"{key}: no file {path}{where}; give an existing .py file (in a recipe, relative to the "
                          f"recipe's folder or the project's: docs/training.md, Paths) or a `package.module:name`")
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
        module = import_file(user_path(target), key)
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
