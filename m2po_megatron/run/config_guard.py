"""What a resume may change: the resolved config a run's checkpoint was trained with against the one the
resume would run, key by key.

A resumed run must continue the same experiment: a checkpoint trained with M2PO and continued with GRPO is
neither, yet its directory would carry one config and `m2po report` one label. So every changed key is
classified:

- SAFE: an explicit allow-list of keys that change how the run is operated, not what it computes
  (`train.steps`, logging, the evaluation schedule, checkpointing, timeouts, ports and addresses, memory-only
  knobs). They pass, and are printed.
- GUARDED: everything else (algo.*, staleness.*, model.*, parallel.*, data.*, reward.*, optim.*, rollout
  sampling, seeds...). A key the allow-list does not name is guarded, so a field added to the schema later
  is refused until someone decides it is safe. Guarded changes stop the resume (exit 2) unless
  `--allow-change KEY` (or `all`) allows them.

Both configs are compared redacted (config/loading.redact), so a secret never appears in a message. Pure:
no files are read here (run/config_history.py reads them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

from m2po_megatron.config import ALL_FIELDS, ConfigError
from m2po_megatron.config.paths import PATH_FIELDS

# Keys (or whole sections, matched as a prefix with a dot) that may change on resume.
SAFE = (
    "run.name", "run.output_dir", "run.resume", "run.overwrite",  # where the run is, how it was started
    "train.steps",  # continue a finished run longer
    "logging",  # wandb, the trace
    "eval.interval", "eval.steps",  # when to evaluate, not how
    "checkpoint",  # interval, keep_last, save_on_sigterm, stop_timeout_s
    "cluster.ray_address", "cluster.ray_tmpdir", "cluster.object_store_memory_mb", "cluster.timeout_s",
    "cluster.gpu_memory_gb",
    "rollout.urls", "rollout.host", "rollout.port", "rollout.api_key", "rollout.request_timeout_s",
    "rollout.max_retries", "rollout.max_restarts", "rollout.health_timeout_s", "rollout.function_timeout_s",
    "rollout.bucket_mb", "rollout.mem_fraction_static",
    "reward.num_workers", "reward.timeout_s",
    "model.hf_id",  # where `m2po download` fetches from; the weights read are model.hf_path
    # activation recompute trades memory for time; the gradients are the same
    "parallel.recompute_granularity", "parallel.recompute_method", "parallel.recompute_num_layers",
)
ALL = "all"
ABSENT = "(not set)"
# Sections of the schema: dict values below them are flattened; a dict-valued field (reward.args) is one key.
_SECTIONS = {f.rsplit(".", 1)[0] for f in ALL_FIELDS if "." in f}


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    safe: bool

    def text(self) -> str:
        old = ABSENT if self.old is _MISSING else repr(self.old)
        return f"{self.key}: {old} -> {self.new!r}"


_MISSING = object()


def _under(key: str, entry: str) -> bool:
    return key == entry or key.startswith(entry + ".")


def is_safe(key: str) -> bool:
    return any(_under(key, s) for s in SAFE)


def flatten(cfg: dict, prefix: str = "") -> dict[str, Any]:
    """{"algo.name": "m2po", "reward.args": {...}, ...}: dotted keys down to the schema's fields."""
    out: dict[str, Any] = {}
    for k, v in (cfg or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key in _SECTIONS:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def diff(old: dict, new: dict, defaults: Optional[dict] = None) -> list[Change]:
    """The keys of the schema whose value differs between two plain (redacted) configs, in schema order.
    A key the old config lacks (written before the field existed) counts as unchanged when the new value
    is the field's default from `defaults`; a key the schema no longer has is not read, so not compared."""
    fo, fn = flatten(old), flatten(new)
    fd = flatten(defaults or {})
    known = set(ALL_FIELDS)
    order = {k: i for i, k in enumerate(ALL_FIELDS)}
    out = []
    for key in sorted(set(fo) | set(fn), key=lambda k: (order.get(k, len(order)), k)):
        if key not in known:
            continue
        a, b = fo.get(key, _MISSING), fn.get(key, _MISSING)
        if a is _MISSING and key in fd and b == fd[key]:
            continue
        if a != b and not _same_paths(key, a, b):
            out.append(Change(key, a, b, is_safe(key)))
    return out


def _same_path(a: Any, b: Any) -> bool:
    """A relative path a run saved before paths were made absolute (config/paths.py) and the absolute path
    a reload gives it now name the same file when the absolute one ends with the relative one."""
    if not (isinstance(a, str) and isinstance(b, str)) or a == b:
        return a == b
    rel, full = (a, b) if not a.startswith("/") else (b, a)
    rel = rel[2:] if rel.startswith("./") else rel
    return full.startswith("/") and not rel.startswith("/") and full.endswith("/" + rel)


def _same_paths(key: str, a: Any, b: Any) -> bool:
    if key not in PATH_FIELDS:
        return False
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_path(x, y) for x, y in zip(a, b))
    return _same_path(a, b)


def parse_allowed(values: Optional[Iterable[str]]) -> tuple[str, ...]:
    """`--allow-change algo.name,staleness --allow-change model.hf_path` -> ("algo.name", "staleness",
    "model.hf_path"); `all` allows every key. ConfigError (exit 2) for a key the schema does not have."""
    keys = tuple(k.strip() for v in (values or ()) for k in str(v).split(",") if k.strip())
    known = set(ALL_FIELDS)  # a field, a whole section, or a key inside a dict-valued field (reward.args.k)
    bad = [k for k in keys if k != ALL and k not in known
           and not any(_under(k, f) for f in known - _SECTIONS)]
    if bad:
        raise ConfigError(f"--allow-change {', '.join(bad)}: no such config key; give dotted keys as "
                          f"`m2po config RECIPE` prints them (algo.name, a whole section such as staleness) "
                          f"or `all`")
    return keys


def is_allowed(key: str, allowed: Iterable[str]) -> bool:
    return any(a == ALL or _under(key, a) for a in allowed)


def refused(changes: list[Change], allowed: Iterable[str]) -> list[Change]:
    """The guarded changes that `allowed` does not cover."""
    return [c for c in changes if not c.safe and not is_allowed(c.key, allowed)]


def refusal(changes: list[Change], where: str) -> str:
    """The message of a refused resume: each key old -> new, then the ways forward."""
    keys = ",".join(c.key for c in changes)
    lines = "\n".join(f"  {c.text()}" for c in changes)
    return (f"resuming {where} would change what the run is ({len(changes)} key(s) differ from the config its "
            f"checkpoint was trained with):\n{lines}\n"
            f"Resume with the old values, start a new run (another run.name, or "
            f"--overwrite), or make the change deliberately with `--allow-change {keys}` (`--allow-change all` "
            f"allows every key); the run's config_history.jsonl records it and `m2po report` labels the run "
            f"by what ran at each step.")
