"""The run config: the typed schema (schema.py), recipe loading with `extends:` and dotted overrides
(loading.py), and the checks that run before any expensive work starts (validation.py).

A recipe is YAML matching `RunConfig`; `load_config(recipe, overrides)` returns the merged, validated,
read-only config or raises ConfigError naming the field and the fix.
"""
from omegaconf import MISSING

from m2po_megatron.config.loading import (as_plain, is_secret, load_config, redact, resolve_recipe_path, run_dir,
                                          save_resolved, secret)
from m2po_megatron.config.paths import RECIPES_DIR, resolve_path
from m2po_megatron.config.schema import ALL_FIELDS, ConfigError, RunConfig
from m2po_megatron.config.validation import estimate_memory, model_hf_config, validate

__all__ = ["RunConfig", "ConfigError", "ALL_FIELDS", "RECIPES_DIR", "load_config", "validate", "save_resolved",
           "redact", "is_secret", "run_dir", "resolve_recipe_path", "resolve_path", "model_hf_config",
           "estimate_memory", "secret", "as_plain", "MISSING"]
