"""The typed schema of a run, recipe loading (YAML with `extends:`), dotted overrides and validation.

A recipe is YAML matching `RunConfig`. `load_config(path, overrides)` merges, in order: the schema's
defaults, the chain of recipes named by `extends:` (parent first), the recipe itself, then dotted
command-line overrides (`algo.m2po.tau=0.02`). Everything is validated before any expensive work starts;
every error names the field and the fix.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
SECRET_MARKERS = ("api_key", "token", "secret", "password")


class ConfigError(ValueError):
    """A recipe or override is wrong; the message names the field and the fix."""


# ----------------------------------------------------------------------------------------------------
# Schema
# ----------------------------------------------------------------------------------------------------
@dataclass
class RunSection:
    name: str = "run"
    output_dir: str = "runs"  # the run directory is output_dir/name
    seed: int = 1234
    resume: str = "none"  # none | auto | PATH of a checkpoint
    overwrite: bool = False  # start over in a run directory that holds another run (it is moved aside)


@dataclass
class ModelSection:
    hf_path: Optional[str] = None  # HF checkpoint dir (config.json + weights); initial weights
    hf_config: Optional[str] = None  # dir or config.json used for validation when hf_path is absent
    tokenizer: Optional[str] = None  # defaults to hf_path
    megatron_ckpt: Optional[str] = None  # initial weights from `m2po convert hf-to-megatron`
    params_dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16 | fp16
    fp8: Optional[str] = None  # null | e4m3 | hybrid (Transformer Engine only)
    fp8_recipe: str = "delayed"  # delayed | tensorwise | blockwise | mxfp8
    # auto (te where Transformer Engine is usable, else sdpa) | te | sdpa (PyTorch fused attention per packed
    # sequence) | local (megatron's dense-mask attention: S x S scores per layer; a reference)
    attention_backend: str = "auto"


@dataclass
class ParallelSection:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    data_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True
    # Megatron's activation recompute: null | selective (core attention) | full (whole layers)
    recompute_granularity: Optional[str] = None
    recompute_method: str = "uniform"  # full only: uniform (chunks of recompute_num_layers) | block
    recompute_num_layers: int = 1  # full only: layers per chunk (uniform) or per stage (block)


@dataclass
class M2POSection:
    tau: float = 0.04
    rule: str = "remove"  # remove (paper Algorithm 1) | cap (released code)
    scope: str = "global"  # global (whole optimizer mini-batch across DP) | microbatch (released code)


@dataclass
class ClipSection:
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2


@dataclass
class GSPOSection:
    eps_clip_low: float = 3e-4
    eps_clip_high: float = 4e-4
    loss_agg_mode: str = "seq-mean-token-mean"  # GSPO's own (paper, verl): each sequence weighs the same


@dataclass
class AlgoSection:
    name: str = "m2po"  # m2po | grpo | grpo_notr | gspo
    # token-mean | seq-mean-token-mean | seq-mean-token-sum, for m2po, grpo and grpo_notr; gspo reads
    # algo.gspo.loss_agg_mode, so one recipe can sweep every method with each one's own aggregation
    loss_agg_mode: str = "token-mean"
    norm_adv_by_std: bool = True
    adv_eps: float = 1e-6
    dual_clip_c: Optional[float] = None  # e.g. 3.0; bounds A<0 tokens with huge ratios, any loss
    m2po: M2POSection = field(default_factory=M2POSection)
    grpo: ClipSection = field(default_factory=ClipSection)
    gspo: GSPOSection = field(default_factory=GSPOSection)


@dataclass
class StalenessSection:
    mode: str = "bounded"  # on_policy | fixed_lag | bounded
    lag_steps: int = 0  # fixed_lag: k batches of lag (staleness = k x updates_per_step)
    max_staleness: int = 4  # bounded: in optimizer updates
    sync_interval: int = 1  # bounded: push weights every this many updates
    drop_too_stale: bool = True  # bounded: drop (counted) or keep samples beyond the bound
    behav_logprob_source: str = "engine"  # engine | trainer (recomputed at generation time)


@dataclass
class RolloutSection:
    engine: str = "local"  # local (CPU server speaking SGLang's protocol) | sglang
    urls: list[str] = field(default_factory=list)  # attach to servers started elsewhere
    num_servers: int = 1
    host: Optional[str] = None  # default: this node's address (never 0.0.0.0)
    port: int = 0  # 0: each server gets a free port, bound by the launcher itself (no race); N: server i on N + i
    api_key: Optional[str] = None  # prefer the M2PO_API_KEY environment variable; never logged
    tp_size: int = 1  # SGLang --tp-size
    dp_size: int = 1  # SGLang --dp-size
    mem_fraction_static: Optional[float] = None  # SGLang --mem-fraction-static
    context_length: Optional[int] = None
    dtype: str = "auto"
    quantization: Optional[str] = None  # e.g. fp8
    n_samples_per_prompt: int = 8  # GRPO group size
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 2560
    max_concurrency: int = 64  # requests in flight per server
    request_timeout_s: float = 600.0
    max_retries: int = 3
    max_restarts: int = 2
    health_timeout_s: float = 600.0
    pause_mode: str = "retract"  # SGLang /pause_generation mode around each weight update: retract | in_place | abort
    deterministic_inference: bool = False  # SGLang --enable-deterministic-inference: sampling seeds take effect
    bucket_mb: int = 512


@dataclass
class DataSection:
    train_path: Optional[str] = None  # prepared JSONL/parquet (m2po prepare-data)
    eval_paths: list[str] = field(default_factory=list)
    # null = the prepared prompt as is; else a preset (m2po, plain) or a format string rendered from each
    # row's `problem`, for training and evaluation alike
    prompt_template: Optional[str] = None
    apply_chat_template: bool = True  # wrap the prompt in the tokenizer's chat template (once)
    max_prompt_len: int = 1534  # + max_new_tokens + 2 must fit the context (SGLang never fills its last 2)
    shuffle_seed: int = 42


@dataclass
class RewardSection:
    format_score: float = 0.0  # paper appendix: 0.1; released code: 0
    num_workers: int = 4
    timeout_s: float = 5.0


@dataclass
class TrainSection:
    steps: int = 1000
    prompts_per_step: int = 256
    updates_per_step: int = 4  # optimizer mini-batches per step
    micro_batch_tokens: int = 30000  # token budget of a packed micro-batch


@dataclass
class OptimSection:
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_schedule: str = "constant"  # constant | cosine
    warmup_updates: int = 0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0


@dataclass
class EvalSection:
    interval: int = 50  # steps; 0 = only before and after training
    n_samples: int = 4
    n_samples_overrides: dict[str, int] = field(default_factory=lambda: {"aime24": 16, "aime25": 16})
    temperature: float = 1.0
    top_p: float = 0.7
    max_new_tokens: Optional[int] = None  # default: rollout.max_new_tokens


@dataclass
class CheckpointSection:
    interval: int = 50  # steps; 0 = only at the end and on SIGTERM
    keep_last: int = 2
    save_on_sigterm: bool = True
    stop_timeout_s: float = 270.0  # after SIGTERM/SIGUSR1: exit without a new checkpoint past this (0 = no limit)


@dataclass
class LoggingSection:
    wandb_mode: str = "disabled"  # online | offline | disabled (WANDB_MODE overrides)
    wandb_project: str = "m2po-megatron"
    wandb_entity: Optional[str] = None
    console: bool = True


@dataclass
class ClusterSection:
    ray_address: str = "local"  # local (private Ray on this machine) | auto | HOST:PORT
    ray_tmpdir: Optional[str] = None
    object_store_memory_mb: int = 512
    trainer_nodes: int = 1
    rollout_nodes: int = 0  # 0 = rollout servers share the trainer's node(s)
    gpus_per_node: int = 0  # 0 = CPU: one trainer process per rank
    gpu_memory_gb: Optional[float] = None  # when set, the per-GPU memory estimate must fit
    timeout_s: float = 3600.0  # longest wait on another process (trainer ranks, servers) before the run stops


@dataclass
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    algo: AlgoSection = field(default_factory=AlgoSection)
    staleness: StalenessSection = field(default_factory=StalenessSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    data: DataSection = field(default_factory=DataSection)
    reward: RewardSection = field(default_factory=RewardSection)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    eval: EvalSection = field(default_factory=EvalSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)


CHOICES = {
    "run.resume": None,  # free-form: none | auto | path
    "model.params_dtype": ("auto", "fp32", "bf16", "fp16"),
    "model.fp8": (None, "e4m3", "hybrid"),
    "model.fp8_recipe": ("delayed", "tensorwise", "blockwise", "mxfp8"),
    "model.attention_backend": ("auto", "te", "sdpa", "local"),
    "parallel.recompute_granularity": (None, "selective", "full"),
    "parallel.recompute_method": ("uniform", "block"),
    "algo.name": ("m2po", "grpo", "grpo_notr", "gspo"),
    "algo.loss_agg_mode": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
    "algo.gspo.loss_agg_mode": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
    "algo.m2po.rule": ("remove", "cap"),
    "algo.m2po.scope": ("global", "microbatch"),
    "staleness.mode": ("on_policy", "fixed_lag", "bounded"),
    "staleness.behav_logprob_source": ("engine", "trainer"),
    "rollout.engine": ("local", "sglang"),
    "rollout.pause_mode": ("retract", "in_place", "abort"),
    "optim.lr_schedule": ("constant", "cosine"),
    "logging.wandb_mode": ("online", "offline", "disabled"),
}

# field -> (lower bound, inclusive?) ; upper bounds handled in _check_ranges
POSITIVE = [
    "parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
    "parallel.context_parallel_size", "parallel.data_parallel_size", "parallel.recompute_num_layers",
    "rollout.num_servers",
    "rollout.tp_size", "rollout.dp_size", "rollout.n_samples_per_prompt", "rollout.max_new_tokens",
    "rollout.max_concurrency", "rollout.request_timeout_s", "rollout.health_timeout_s", "rollout.bucket_mb",
    "data.max_prompt_len", "reward.num_workers", "reward.timeout_s", "train.steps",
    "train.prompts_per_step", "train.updates_per_step", "train.micro_batch_tokens",
    "staleness.sync_interval", "eval.n_samples", "checkpoint.keep_last", "cluster.trainer_nodes",
    "cluster.object_store_memory_mb", "cluster.timeout_s",
]
NON_NEGATIVE = [
    "staleness.lag_steps", "staleness.max_staleness", "algo.m2po.tau", "algo.grpo.eps_clip_low",
    "algo.grpo.eps_clip_high", "algo.gspo.eps_clip_low", "algo.gspo.eps_clip_high", "optim.lr",
    "optim.min_lr", "optim.weight_decay", "optim.clip_grad", "optim.warmup_updates", "eval.interval",
    "checkpoint.interval", "rollout.max_retries", "rollout.max_restarts", "cluster.rollout_nodes",
    "cluster.gpus_per_node", "reward.format_score", "rollout.temperature", "algo.adv_eps", "optim.adam_eps",
    "rollout.port", "checkpoint.stop_timeout_s",
]


# ----------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------
def _field_paths(node: Any, prefix: str = "") -> list[str]:
    out = []
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            path = f"{prefix}{f.name}"
            out.append(path)
            out.extend(_field_paths(getattr(node, f.name), path + "."))
    return out


ALL_FIELDS = _field_paths(RunConfig())


def _suggest(key: str) -> str:
    close = difflib.get_close_matches(key, ALL_FIELDS, n=1, cutoff=0.6)
    if not close:  # try the leaf name alone, anywhere in the schema
        leaf = key.rsplit(".", 1)[-1]
        leaves = {p.rsplit(".", 1)[-1]: p for p in ALL_FIELDS}
        m = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.7)
        close = [leaves[m[0]]] if m else []
    return f"; did you mean '{close[0]}'?" if close else ""


REMOVED = {
    "rollout.router": "the client balances over the servers itself (weight sync, pause and abort must reach "
                      "every server anyway), so sglang-router is not used; delete the key",
    "rollout.update_mode": "SGLang 0.5.23 cannot update weights while requests run (an update waits for every "
                           "running request; tokens never change version mid-sequence), so every update pauses; "
                           "use rollout.pause_mode = in_place to keep running requests and continue them with "
                           "the new weights",
}


def _check_keys(data: Any, schema: Any, prefix: str, source: str) -> None:
    """Unknown keys fail with the closest valid key (OmegaConf's own message lacks the suggestion)."""
    if not isinstance(data, dict):
        return
    names = {f.name: f for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    if names is None:
        return
    for key, value in data.items():
        path = f"{prefix}{key}"
        if path in REMOVED:
            raise ConfigError(f"{source}: '{path}' was removed: {REMOVED[path]}")
        if key not in names:
            raise ConfigError(f"{source}: unknown key '{path}'{_suggest(path)}")
        sub = getattr(schema, key)
        if dataclasses.is_dataclass(sub):
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"{source}: '{path}' must be a mapping of its fields, got {value!r}")
            _check_keys(value, sub, path + ".", source)


def resolve_recipe_path(ref: str, base_dir: Optional[Path] = None) -> Path:
    """A recipe reference: a path (absolute, or relative to the referring recipe / cwd) or a recipe name
    under recipes/ with or without `.yaml`."""
    cands = []
    p = Path(ref)
    if p.is_absolute():
        cands.append(p)
    else:
        if base_dir is not None:
            cands.append(base_dir / p)
        cands += [Path.cwd() / p, RECIPES_DIR / p]
    cands += [c.with_name(c.name + ".yaml") for c in list(cands) if c.suffix != ".yaml"]  # qwen3-1.7b-base
    for c in cands:
        if c.is_file():
            return c.resolve()
    raise ConfigError(f"recipe '{ref}' not found (looked in {', '.join(str(c) for c in cands[:3])}, ...); "
                      f"give a path to a YAML file or a name under {RECIPES_DIR}")


def _read_recipe_chain(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict]]:
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise ConfigError(f"recipe inheritance loop: {chain}; remove one `extends:`")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of sections, got {type(data).__name__}")
    _acyclic(data, str(path))
    parent = data.pop("extends", None)
    chain: list[tuple[Path, dict]] = []
    if parent:
        parents = parent if isinstance(parent, list) else [parent]
        for ref in parents:
            chain += _read_recipe_chain(resolve_recipe_path(str(ref), path.parent), (*seen, path))
    chain.append((path, data))
    return chain


def _acyclic(value: Any, where: str, seen: tuple = ()) -> None:
    """YAML anchors can build a list that contains itself (`&a [*a]`); no config value can be one."""
    if isinstance(value, (list, dict)):
        if any(value is s for s in seen):
            raise ConfigError(f"{where}: the value refers to itself (a YAML anchor loop); write it out")
        for v in value.values() if isinstance(value, dict) else value:
            _acyclic(v, where, (*seen, value))


def _parse_overrides(overrides: list[str]) -> dict:
    out: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like section.field=value (e.g. algo.m2po.tau=0.02)")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("+")
        if not key:
            raise ConfigError(f"override '{item}' has no key")
        try:
            value = yaml.safe_load(raw) if raw.strip() != "" else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override '{item}': the value is not valid YAML ({str(e).splitlines()[0]}); "
                              f"quote it, e.g. {key}='\"...\"'") from None
        _acyclic(value, f"override '{item}'")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}' conflicts with another override of '{part}'")
        node[parts[-1]] = value
    return out


def load_config(recipe: Optional[str | Path] = None, overrides: Optional[list[str]] = None,
                check_files: bool = True) -> DictConfig:
    """Load, merge and validate a run config. Raises ConfigError naming the field and the fix."""
    layers: list[tuple[str, dict]] = []
    if recipe is not None:
        path = resolve_recipe_path(str(recipe))
        layers += [(str(p), d) for p, d in _read_recipe_chain(path)]
    if overrides:
        layers.append(("command-line override", _parse_overrides(overrides)))

    cfg = OmegaConf.structured(RunConfig)
    for source, data in layers:
        _check_keys(data, RunConfig(), "", source)
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.create(data))
        except ValidationError as e:
            key = getattr(e, "full_key", None) or "?"
            first = str(e).strip().splitlines()[0]
            raise ConfigError(f"{source}: '{key}' has the wrong type: {first}; "
                              f"expected {_expected_type(key)}") from None
        except (ConfigKeyError, OmegaConfBaseException, TypeError, ValueError, RecursionError) as e:  # a.list.x=1
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"{source}: cannot apply {_leaves(data)}: {first}; check the keys and the "
                              f"value types against `m2po config RECIPE`") from None
    validate(cfg, check_files=check_files)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _leaves(data: Any, prefix: str = "") -> str:
    if isinstance(data, dict):
        return ", ".join(_leaves(v, f"{prefix}{k}.") for k, v in data.items()) or prefix.rstrip(".")
    return prefix.rstrip(".")


def _expected_type(key: str) -> str:
    node: Any = RunConfig()
    fld = None
    for part in key.split("."):
        if not dataclasses.is_dataclass(node):
            break
        fld = {f.name: f for f in dataclasses.fields(node)}.get(part)
        if fld is None:
            break
        node = getattr(node, part)
    return str(fld.type) if fld is not None else "the schema's type"


# ----------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------
def _get(cfg: DictConfig, path: str) -> Any:
    return OmegaConf.select(cfg, path)


def resolve_path(ref: str) -> Path:
    """A user path: as given (absolute or relative to the working directory), else relative to the
    repository root (recipes name bundled files such as m2po_megatron/assets/configs/... that way)."""
    p = Path(os.path.expandvars(os.path.expanduser(ref)))
    if p.is_absolute() or p.exists():
        return p
    in_repo = RECIPES_DIR.parent / p
    return in_repo if in_repo.exists() else p


def read_hf_config(cfg: DictConfig, check_files: bool = False) -> Optional[dict]:
    """The model's HF config.json as a dict (from model.hf_config or model.hf_path), or None. With
    check_files, a model.hf_config that is set but missing is an error."""
    for key in ("model.hf_config", "model.hf_path"):
        ref = _get(cfg, key)
        if not ref:
            continue
        p = resolve_path(ref)
        p = p / "config.json" if p.is_dir() or not p.suffix else p
        if p.is_file():
            try:
                return json.loads(p.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{key}: {p} is not valid JSON ({e})") from None
        if key == "model.hf_config" and check_files:
            raise ConfigError(f"model.hf_config = {ref!r}: no config.json there; give an HF model dir or "
                              f"config.json path")
    return None


def validate(cfg: DictConfig, check_files: bool = True) -> None:
    errors: list[str] = []

    for path, choices in CHOICES.items():
        if choices is None:
            continue
        value = _get(cfg, path)
        if value not in choices:
            shown = ", ".join("null" if c is None else str(c) for c in choices)
            hint = difflib.get_close_matches(str(value), [str(c) for c in choices if c is not None], n=1)
            errors.append(f"{path} = {value!r} is not one of: {shown}"
                          + (f"; did you mean '{hint[0]}'?" if hint else ""))
    for path in POSITIVE:
        v = _get(cfg, path)
        if v is None or v <= 0:
            errors.append(f"{path} = {v!r} must be > 0")
    for path in NON_NEGATIVE:
        v = _get(cfg, path)
        if v is not None and v < 0:
            errors.append(f"{path} = {v!r} must be >= 0")
    if not 0 < cfg.rollout.top_p <= 1:
        errors.append(f"rollout.top_p = {cfg.rollout.top_p} must be in (0, 1]")
    if not 0 < cfg.eval.top_p <= 1:
        errors.append(f"eval.top_p = {cfg.eval.top_p} must be in (0, 1]")
    for b in ("adam_beta1", "adam_beta2"):
        if not 0 <= cfg.optim[b] < 1:
            errors.append(f"optim.{b} = {cfg.optim[b]} must be in [0, 1)")
    if cfg.algo.dual_clip_c is not None and cfg.algo.dual_clip_c <= 1:
        errors.append(f"algo.dual_clip_c = {cfg.algo.dual_clip_c} must be > 1 (e.g. 3.0), or null to disable")
    if cfg.rollout.mem_fraction_static is not None and not 0 < cfg.rollout.mem_fraction_static < 1:
        errors.append(f"rollout.mem_fraction_static = {cfg.rollout.mem_fraction_static} must be in (0, 1)")
    if cfg.data.prompt_template is not None:
        from m2po_megatron.data.prepare import resolve_template

        try:
            resolve_template(cfg.data.prompt_template)
        except ValueError as e:
            errors.append(f"data.prompt_template: {e}")
    if cfg.run.resume not in ("none", "auto") and check_files and not Path(cfg.run.resume).exists():
        errors.append(f"run.resume = {cfg.run.resume!r}: no such checkpoint; use 'auto', 'none' or a path")
    if cfg.rollout.n_samples_per_prompt == 1:
        errors.append("rollout.n_samples_per_prompt = 1: GRPO advantages (reward minus the group mean) are then "
                      "always 0 and nothing is learned; use at least 2 (the paper uses 8)")
    if cfg.rollout.port and cfg.rollout.port + cfg.rollout.num_servers - 1 > 65535:
        errors.append(f"rollout.port = {cfg.rollout.port}: server i listens on port + i, which must stay <= 65535; "
                      "use rollout.port=0 (a free port per server)")

    _check_layout(cfg, errors)
    _check_batches(cfg, errors)
    _check_model(cfg, errors, check_files)
    _check_rollout(cfg, errors)
    if check_files:
        _check_data_files(cfg, errors)

    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


def _check_layout(cfg: DictConfig, errors: list[str]) -> None:
    p = cfg.parallel
    tp, pp, cp, dp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                      p.context_parallel_size, p.data_parallel_size)
    if p.sequence_parallel and tp == 1:
        errors.append("parallel.sequence_parallel = true needs parallel.tensor_model_parallel_size > 1; "
                      "set it to false")
    vpp = p.virtual_pipeline_model_parallel_size
    if vpp is not None and (vpp < 1 or pp < 2):
        errors.append(f"parallel.virtual_pipeline_model_parallel_size = {vpp} needs "
                      f"pipeline_model_parallel_size >= 2 and a value >= 1; or set it to null")
    # layouts the actor cannot run: refused here, before Ray starts
    if cp > 1:
        errors.append(f"parallel.context_parallel_size = {cp}: the actor does not split packed rows over "
                      f"context-parallel ranks; set it to 1 (use tensor/pipeline/data parallelism)")
    if vpp is not None and vpp > 1:
        errors.append(f"parallel.virtual_pipeline_model_parallel_size = {vpp}: the actor runs one model chunk per "
                      f"pipeline stage; set it to null")
    if cfg.model.params_dtype == "fp16":
        errors.append("model.params_dtype = fp16: the actor has no loss scaling for fp16; use bf16 (or auto)")
    backend = cfg.model.attention_backend
    if p.sequence_parallel and backend in ("sdpa", "local"):
        errors.append(f"parallel.sequence_parallel = true needs Transformer Engine layers: set "
                      f"model.attention_backend = te (or auto on a GPU with TE), not {backend}")
    if cfg.model.fp8 and backend in ("sdpa", "local"):
        errors.append(f"model.fp8 runs on Transformer Engine layers: set model.attention_backend = te (or auto), "
                      f"not {backend}")
    c = cfg.cluster
    if c.gpus_per_node > 0 and c.gpus_per_node % tp:
        errors.append(f"cluster.gpus_per_node = {c.gpus_per_node} is not a multiple of "
                      f"parallel.tensor_model_parallel_size = {tp}: a tensor-parallel group must sit on one node")
    if c.gpus_per_node > 0:
        trainer_gpus = c.trainer_nodes * c.gpus_per_node
        if trainer_gpus != tp * pp * cp * dp:
            errors.append(
                f"trainer GPUs = cluster.trainer_nodes x cluster.gpus_per_node = {c.trainer_nodes} x "
                f"{c.gpus_per_node} = {trainer_gpus}, but tensor x pipeline x context x data parallel = "
                f"{tp} x {pp} x {cp} x {dp} = {tp * pp * cp * dp}; make them equal "
                f"(e.g. parallel.data_parallel_size = {max(1, trainer_gpus // (tp * pp * cp))})")
        if c.rollout_nodes > 0 and cfg.rollout.engine == "sglang":
            per_server = cfg.rollout.tp_size * cfg.rollout.dp_size  # GPUs of one server
            rollout_gpus = c.rollout_nodes * c.gpus_per_node
            if rollout_gpus % per_server:
                errors.append(f"rollout GPUs = {rollout_gpus} are not a multiple of "
                              f"rollout.tp_size x rollout.dp_size = {per_server}")
            if not cfg.rollout.urls and cfg.rollout.num_servers * per_server > rollout_gpus:
                errors.append(f"rollout.num_servers x rollout.tp_size x rollout.dp_size = {cfg.rollout.num_servers} "
                              f"x {cfg.rollout.tp_size} x {cfg.rollout.dp_size} GPUs exceed the {rollout_gpus} "
                              f"rollout GPUs; use rollout.num_servers = {max(1, rollout_gpus // per_server)}")


def _check_batches(cfg: DictConfig, errors: list[str]) -> None:
    t, s = cfg.train, cfg.staleness
    if t.prompts_per_step % t.updates_per_step:
        errors.append(f"train.prompts_per_step = {t.prompts_per_step} must be divisible by "
                      f"train.updates_per_step = {t.updates_per_step} (prompts per optimizer mini-batch)")
    else:
        per_update = t.prompts_per_step // t.updates_per_step
        dp = cfg.parallel.data_parallel_size
        seqs = per_update * cfg.rollout.n_samples_per_prompt
        if seqs % dp:
            errors.append(f"sequences per mini-batch = {per_update} prompts x rollout.n_samples_per_prompt "
                          f"{cfg.rollout.n_samples_per_prompt} = {seqs} must be divisible by "
                          f"parallel.data_parallel_size = {dp}")
    if s.mode == "on_policy" and (s.lag_steps or 0) > 0:
        errors.append("staleness.lag_steps > 0 needs staleness.mode = fixed_lag (on_policy means lag 0)")
    if s.mode == "bounded" and s.sync_interval > max(1, s.max_staleness):
        errors.append(f"staleness.sync_interval = {s.sync_interval} exceeds staleness.max_staleness = "
                      f"{s.max_staleness}: the servers would always be too stale; lower sync_interval")
    if s.mode == "bounded" and s.behav_logprob_source == "trainer":
        errors.append("staleness.behav_logprob_source = trainer needs synchronous generation (on_policy or "
                      "fixed_lag): in bounded mode the trainer has moved past the generating weights; use engine")
    if cfg.rollout.engine == "sglang" and not cfg.rollout.urls and cfg.cluster.gpus_per_node == 0:
        errors.append("rollout.engine = sglang needs GPUs (cluster.gpus_per_node > 0) or rollout.urls of "
                      "running servers; use rollout.engine = local on CPU")
    if cfg.model.fp8 and cfg.model.params_dtype in ("fp32",):
        errors.append("model.fp8 needs model.params_dtype = bf16 (or auto on GPU)")


def _raw(cfg: DictConfig, path: str) -> str:
    """The value of `path` (dotted, list items as [i]) as written in the recipe, interpolations unresolved."""
    node: Any = OmegaConf.to_container(cfg, resolve=False)
    for part in re.findall(r"[^.\[\]]+", path):
        node = node[int(part)] if isinstance(node, list) and part.isdigit() and int(part) < len(node) else (
            node.get(part) if isinstance(node, dict) else None)
    return str(node)


def _missing_file_hint(cfg: DictConfig, path: str, value: str, what: str) -> str:
    """How to get a missing model or data file: the tiny task is built by `m2po demo`; paper recipes find
    weights and data through M2PO_MODELS_DIR / M2PO_DATA_DIR."""
    raw = _raw(cfg, path)
    if "tiny-task" in value:
        return "the tiny task is built by `m2po demo` (or `make demo`) under .cache/tiny-task; run it once"
    for env, how in (("M2PO_MODELS_DIR", "the directory holding the HF weights"),
                     ("M2PO_DATA_DIR", "DIR where `m2po prepare-data ... --out DIR/deepscaler` wrote")):
        if env in raw:
            return (f"set {env} to {how} (now {os.environ.get(env, 'unset')}; the recipe reads {raw}), or "
                    f"validate the recipe without files: `m2po config RECIPE --no-check-files`")
    return f"give an existing {what}, or validate without files: `m2po config RECIPE --no-check-files`"


def _check_data_files(cfg: DictConfig, errors: list[str]) -> None:
    paths = [("data.train_path", cfg.data.train_path)] if cfg.data.train_path else []
    paths += [(f"data.eval_paths[{i}]", p) for i, p in enumerate(cfg.data.eval_paths)]
    missing = [(k, p) for k, p in paths if not Path(os.path.expanduser(str(p))).is_file()]
    if missing:
        shown = ", ".join(f"{k} = {p!r}" for k, p in missing[:3]) + (f" and {len(missing) - 3} more"
                                                                       if len(missing) > 3 else "")
        errors.append(f"no such file: {shown}; {_missing_file_hint(cfg, missing[0][0], str(missing[0][1]), 'data file')}")


def _check_model(cfg: DictConfig, errors: list[str], check_files: bool) -> None:
    if check_files and cfg.model.hf_path and not Path(os.path.expanduser(cfg.model.hf_path)).exists():
        errors.append(f"model.hf_path = {cfg.model.hf_path!r} does not exist; "
                      f"{_missing_file_hint(cfg, 'model.hf_path', cfg.model.hf_path, 'HF checkpoint directory')}")
    try:
        hf = read_hf_config(cfg, check_files)
    except ConfigError as e:
        errors.append(str(e))
        return
    if hf is None:
        return
    before = len(errors)
    p = cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    heads = hf.get("num_attention_heads")
    kv = hf.get("num_key_value_heads") or heads
    layers = hf.get("num_hidden_layers")
    if heads and heads % tp:
        errors.append(f"num_attention_heads = {heads} (model config) is not divisible by "
                      f"parallel.tensor_model_parallel_size = {tp}; use a divisor of {heads}")
    if kv and kv % tp:
        errors.append(f"num_key_value_heads = {kv} (model config) is not divisible by "
                      f"parallel.tensor_model_parallel_size = {tp}; use a divisor of {kv}")
    vpp = p.virtual_pipeline_model_parallel_size or 1
    if layers and layers % (pp * vpp):
        errors.append(f"num_hidden_layers = {layers} (model config) is not divisible by "
                      f"pipeline_model_parallel_size x virtual stages = {pp} x {vpp}")
    per_stage = layers // pp if layers and layers % pp == 0 else None
    if per_stage and p.recompute_granularity == "full":
        n = p.recompute_num_layers
        if p.recompute_method == "uniform" and per_stage % n:
            errors.append(f"parallel.recompute_num_layers = {n} must divide the {per_stage} layers of a pipeline "
                          f"stage with recompute_method = uniform; use a divisor of {per_stage}")
        if p.recompute_method == "block" and n > per_stage:
            errors.append(f"parallel.recompute_num_layers = {n} exceeds the {per_stage} layers of a pipeline "
                          f"stage (recompute_method = block); use at most {per_stage}")
    _check_context(cfg, hf, errors)
    if cfg.cluster.gpu_memory_gb and len(errors) == before:  # the estimate needs a layout that divides
        try:
            est = estimate_memory(cfg, hf)
        except ConfigError as e:
            errors.append(str(e))
            return
        if est["total"] > cfg.cluster.gpu_memory_gb:
            from m2po_megatron.models.memory import format_estimate

            errors.append(f"estimated trainer memory {est['total']:.1f} GiB per GPU exceeds cluster.gpu_memory_gb = "
                          f"{cfg.cluster.gpu_memory_gb}; raise tensor/pipeline parallel size or lower "
                          f"train.micro_batch_tokens ({format_estimate(est)})")


def estimate_memory(cfg: DictConfig, hf: Optional[dict] = None) -> Optional[dict]:
    """The per-GPU memory estimate of a trainer rank in GiB (m2po_megatron.models.memory), or None when the model's
    config.json is not known. A layout it cannot compute is a ConfigError naming the field."""
    hf = hf if hf is not None else read_hf_config(cfg)
    if hf is None:
        return None
    from m2po_megatron.models.memory import estimate_gpu_memory

    p = cfg.parallel
    dtype = cfg.model.params_dtype
    if dtype == "auto":
        dtype = "bf16" if cfg.cluster.gpus_per_node > 0 else "fp32"
    try:
        return estimate_gpu_memory(
            hf, tensor_model_parallel_size=p.tensor_model_parallel_size,
            pipeline_model_parallel_size=p.pipeline_model_parallel_size, data_parallel_size=p.data_parallel_size,
            micro_batch_tokens=cfg.train.micro_batch_tokens, use_distributed_optimizer=p.use_distributed_optimizer,
            params_dtype=dtype, fp8=bool(cfg.model.fp8), sequence_parallel=p.sequence_parallel,
            recompute=p.recompute_granularity, context_parallel_size=p.context_parallel_size,
            attention_backend=_gpu_attention_backend(cfg.model.attention_backend))
    except ValueError as e:
        raise ConfigError(f"memory estimate of this layout: {e} (parallel.*); use sizes that divide the model") from None


def _gpu_attention_backend(requested: str) -> str:
    """The backend a GPU trainer would build for `requested` ("auto": TE when this environment has it)."""
    if requested != "auto":
        return requested
    import importlib.util

    return "te" if importlib.util.find_spec("transformer_engine") is not None else "sdpa"


# ----------------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------------
def _check_context(cfg: DictConfig, hf: dict, errors: list[str]) -> None:
    """Every prompt up to data.max_prompt_len must get its full max_new_tokens from SGLang: it answers HTTP 400
    when prompt + max_new_tokens exceeds the context length, and never generates into the context's last
    OUTPUT_RESERVED_TOKENS positions (m2po_megatron/rollout/protocol.py)."""
    from m2po_megatron.rollout.protocol import OUTPUT_RESERVED_TOKENS

    longest = hf.get("max_position_embeddings")
    r = cfg.rollout
    if r.context_length and longest and r.context_length > longest and not hf.get("rope_scaling"):
        errors.append(f"rollout.context_length = {r.context_length} exceeds the model's max_position_embeddings "
                      f"= {longest} (SGLang refuses to start); use at most {longest}")
    ctx = r.context_length or (None if hf.get("rope_scaling") else longest)
    for name, new in (("rollout.max_new_tokens", r.max_new_tokens), ("eval.max_new_tokens", cfg.eval.max_new_tokens)):
        need = cfg.data.max_prompt_len + (new or 0) + OUTPUT_RESERVED_TOKENS
        if ctx and new and need > ctx:
            which = "rollout.context_length" if r.context_length else "the model's max_position_embeddings"
            errors.append(f"data.max_prompt_len + {name} + {OUTPUT_RESERVED_TOKENS} (SGLang keeps the context's last "
                          f"{OUTPUT_RESERVED_TOKENS} positions) = {need} exceeds {which} = {ctx}; lower "
                          f"data.max_prompt_len to {ctx - new - OUTPUT_RESERVED_TOKENS} or {name} to "
                          f"{ctx - cfg.data.max_prompt_len - OUTPUT_RESERVED_TOKENS}")


def _check_rollout(cfg: DictConfig, errors: list[str]) -> None:
    if cfg.rollout.dp_size > 1:
        errors.append(f"rollout.dp_size = {cfg.rollout.dp_size}: SGLang 0.5.23 updates weights from distributed "
                      "only with dp_size 1; set rollout.dp_size = 1 and rollout.num_servers to the number of "
                      "replicas")


def is_secret(key: str) -> bool:
    """Names of credentials (api_key, wandb_api_key, hf_token, secret, password), not metrics such as
    `tokens_per_s/gen` or `staleness/token_mean`."""
    leaf = re.split(r"[./]", key.lower())[-1]
    return any(leaf == m or leaf.endswith("_" + m) for m in SECRET_MARKERS)


def redact(obj: Any) -> Any:
    """A plain copy with secret-looking fields replaced by '***' (set ones) so they never reach disk/logs."""
    if isinstance(obj, DictConfig):
        obj = OmegaConf.to_container(obj, resolve=True)
    if isinstance(obj, dict):
        return {k: ("***" if is_secret(str(k)) and v else redact(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return obj


def run_dir(cfg: DictConfig) -> Path:
    return Path(cfg.run.output_dir) / cfg.run.name


def save_resolved(cfg: DictConfig, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / "config.yaml"
    out.write_text(yaml.safe_dump(redact(cfg), sort_keys=False))
    return out


def secret(cfg_value: Optional[str], env: str) -> Optional[str]:
    """A secret from the config or, preferably, the environment."""
    return os.environ.get(env) or cfg_value


def as_plain(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


__all__ = ["RunConfig", "ConfigError", "load_config", "validate", "save_resolved", "redact", "run_dir",
           "read_hf_config", "estimate_memory", "secret", "as_plain", "MISSING"]
