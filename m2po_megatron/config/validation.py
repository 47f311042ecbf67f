"""Validation of a merged run config: choice and range tables, then cross-field checks (layout, batches,
model config, context length, files). Every error names the field and the fix; all are reported together.
"""
from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from m2po_megatron.config.paths import resolve_path
from m2po_megatron.agents.loader import check_plugins
from m2po_megatron.reward.checks import check_reward
from m2po_megatron.config.algo_checks import check_algo_terms
from m2po_megatron.config.colocate_checks import check_colocate
from m2po_megatron.config.schema import ConfigError
from m2po_megatron.config.files import check_data_files, missing_file_hint

def choices() -> dict[str, tuple | None]:
    """Each enumerated field's allowed values; a value the code implements is named where it is implemented
    (imported here, when a recipe is checked, not when this module is)."""
    from m2po_megatron.actor.routing_replay import REPLAY_MODES
    from m2po_megatron.actor.settings import LR_SCHEDULES, M2PO_SCOPES, RECOMPUTE_GRANULARITIES
    from m2po_megatron.algo.losses import AGG_MODES, LOSSES
    from m2po_megatron.algo.mask import M2_TOKENS, RULES
    from m2po_megatron.algo.rollout_correction import GEOMETRIC_ACTIONS, LEVELS as CORRECTION_LEVELS
    from m2po_megatron.algo.rollout_correction import MODES as CORRECTION_MODES, REJECTIONS
    from m2po_megatron.data.rows import PROMPT_FORMATS
    from m2po_megatron.reward.compose import ON_ERROR
    from m2po_megatron.models.builder import ATTENTION_BACKENDS, FP8_FORMATS, FP8_RECIPES
    from m2po_megatron.rollout.groups import FILTER_METRICS
    from m2po_megatron.rollout.weight_sync import PAUSE_MODES

    return {
        "run.resume": None,  # free-form: none | auto | path
        "model.params_dtype": ("auto", "fp32", "bf16", "fp16"),  # fp16 is refused with its reason below
        "model.fp8": (None, *FP8_FORMATS),
        "model.fp8_recipe": FP8_RECIPES,
        "model.attention_backend": ATTENTION_BACKENDS,
        "parallel.recompute_granularity": RECOMPUTE_GRANULARITIES,
        "parallel.recompute_method": ("uniform", "block"),
        "algo.name": LOSSES,
        "algo.loss_agg_mode": AGG_MODES,
        "algo.routing_replay": REPLAY_MODES,
        "algo.gspo.loss_agg_mode": AGG_MODES,
        "algo.m2po.rule": RULES,
        "algo.m2po.m2_tokens": M2_TOKENS,
        "algo.m2po.scope": M2PO_SCOPES,
        "algo.rollout_correction.mode": CORRECTION_MODES,
        "algo.rollout_correction.level": (None, *CORRECTION_LEVELS),
        "algo.rollout_correction.geometric_action": GEOMETRIC_ACTIONS,
        "algo.rollout_correction.rejection": (None, *REJECTIONS),
        "staleness.mode": ("on_policy", "fixed_lag", "bounded"),
        "train.filter_groups.metric": FILTER_METRICS,
        "data.prompt_format": PROMPT_FORMATS,
        "reward.on_error": ON_ERROR,
        "staleness.behav_logprob_source": ("engine", "trainer"),
        "rollout.engine": ("local", "sglang"),
        "rollout.pause_mode": PAUSE_MODES,
        "optim.lr_schedule": LR_SCHEDULES,
        "logging.wandb_mode": ("online", "offline", "disabled"),
    }

# fields that must be > 0 and >= 0; other ranges (top_p, betas, ...) are checked in validate()
POSITIVE = [
    "parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
    "parallel.context_parallel_size", "parallel.data_parallel_size", "parallel.recompute_num_layers",
    "parallel.expert_model_parallel_size",
    "rollout.num_servers",
    "rollout.tp_size", "rollout.dp_size", "rollout.n_samples_per_prompt", "rollout.max_new_tokens",
    "rollout.max_concurrency", "rollout.request_timeout_s", "rollout.health_timeout_s", "rollout.bucket_mb",
    "data.max_prompt_len", "reward.num_workers", "reward.timeout_s", "train.steps",
    "train.prompts_per_step", "train.updates_per_step", "train.micro_batch_tokens",
    "staleness.sync_interval", "eval.n_samples", "checkpoint.keep_last", "cluster.trainer_nodes",
    "cluster.object_store_memory_mb", "cluster.timeout_s", "logging.trace_limit",
]
NON_NEGATIVE = [
    "staleness.lag_steps", "staleness.max_staleness", "algo.m2po.tau", "algo.grpo.eps_clip_low",
    "algo.grpo.eps_clip_high", "algo.gspo.eps_clip_low", "algo.gspo.eps_clip_high", "algo.cispo.eps_clip_low",
    "algo.cispo.eps_clip_high", "optim.lr",
    "optim.min_lr", "optim.weight_decay", "optim.clip_grad", "optim.warmup_updates", "eval.interval",
    "checkpoint.interval", "rollout.max_retries", "rollout.max_restarts", "cluster.rollout_nodes",
    "cluster.gpus_per_node", "cluster.trainer_gpus_per_node", "reward.format_score", "rollout.temperature", "algo.adv_eps", "optim.adam_eps",
    "rollout.port", "checkpoint.stop_timeout_s", "train.filter_groups.max_num_gen_batches",
    "model.moe_aux_loss_coeff",
]


def _get(cfg: DictConfig, path: str) -> Any:
    return OmegaConf.select(cfg, path)


def model_hf_config(cfg: DictConfig, check_files: bool = False) -> Optional[dict]:
    """The model's HF config.json as a dict (from model.hf_config or model.hf_path), or None. With
    check_files, a model.hf_config that is set but missing is an error."""
    for key in ("model.hf_config", "model.hf_path"):
        ref = _get(cfg, key)
        if not ref:
            continue
        p = resolve_path(ref)
        p = p / "config.json" if p.is_dir() or not p.suffix else p
        if p.is_file():
            from m2po_megatron.models.hf_config import load_hf_config_dict

            try:
                return load_hf_config_dict(p)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{key}: {p} is not valid JSON ({e})") from None
        if key == "model.hf_config" and check_files:
            raise ConfigError(f"model.hf_config = {ref!r}: no config.json there; give an HF model dir or "
                              f"config.json path")
    return None


def validate(cfg: DictConfig, check_files: bool = True) -> None:
    errors: list[str] = []

    for path, allowed in choices().items():
        if allowed is None:
            continue
        value = _get(cfg, path)
        if value not in allowed:
            shown = ", ".join("null" if c is None else str(c) for c in allowed)
            hint = difflib.get_close_matches(str(value), [str(c) for c in allowed if c is not None], n=1)
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
    etp = cfg.parallel.expert_tensor_parallel_size
    if etp is not None and etp < 1:
        errors.append(f"parallel.expert_tensor_parallel_size = {etp} must be >= 1, or null (= "
                      f"tensor_model_parallel_size, megatron-core's default)")
    if not 0 < cfg.rollout.top_p <= 1:
        errors.append(f"rollout.top_p = {cfg.rollout.top_p} must be in (0, 1]")
    steps = _get(cfg, "eval.steps") or []
    if any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in steps):
        errors.append(f"eval.steps = {list(steps)!r} must be a list of steps >= 1 (step 0 is always evaluated), "
                      f"e.g. [4, 8, 16]")
    if not 0 < cfg.eval.top_p <= 1:
        errors.append(f"eval.top_p = {cfg.eval.top_p} must be in (0, 1]")
    for b in ("adam_beta1", "adam_beta2"):
        if not 0 <= cfg.optim[b] < 1:
            errors.append(f"optim.{b} = {cfg.optim[b]} must be in [0, 1)")
    _check_rollout_correction(cfg, errors)
    check_algo_terms(cfg.algo, errors)
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
    check_colocate(cfg, _trainer_world(cfg), errors)
    check_plugins(cfg, errors)
    errors += check_reward(cfg)
    if check_files:
        check_data_files(cfg, errors)

    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))


def _check_rollout_correction(cfg: DictConfig, errors: list[str]) -> None:
    """algo.rollout_correction through the spec the actor builds (its errors name the field), plus where the
    proximal log-probs cannot differ from the behaviour's."""
    from m2po_megatron.algo.rollout_correction import CorrectionSpec

    rc = cfg.algo.rollout_correction
    allowed = choices()
    if any(rc[k] not in allowed[f"algo.rollout_correction.{k}"] for k in ("mode", "level", "geometric_action",
                                                                        "rejection")):
        return  # already reported, with a suggestion
    try:
        CorrectionSpec(**dict(rc))
    except (ValueError, TypeError) as e:
        errors.append(f"algo.{e}" if str(e).startswith("rollout_correction") else f"algo.rollout_correction: {e}")


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
    if cfg.model.fp8 and backend in ("sdpa", "local"):
        errors.append(f"model.fp8 runs on Transformer Engine layers: set model.attention_backend = te (or auto), "
                      f"not {backend}")
    c = cfg.cluster
    per_node = c.trainer_gpus_per_node or c.gpus_per_node  # trainer ranks per trainer node
    if c.gpus_per_node > 0 and per_node % tp:
        which = "trainer_gpus_per_node" if c.trainer_gpus_per_node else "gpus_per_node"
        errors.append(f"cluster.{which} = {per_node} is not a multiple of "
                      f"parallel.tensor_model_parallel_size = {tp}: a tensor-parallel group must sit on one node")
    if c.trainer_gpus_per_node and (c.gpus_per_node == 0 or c.trainer_gpus_per_node > c.gpus_per_node):
        errors.append(f"cluster.trainer_gpus_per_node = {c.trainer_gpus_per_node} needs GPUs and at most "
                      f"cluster.gpus_per_node = {c.gpus_per_node}; set it to 0 (all of them) or up to it")
    elif c.gpus_per_node > 0:
        trainer_gpus = c.trainer_nodes * per_node
        if trainer_gpus != tp * pp * cp * dp:
            what = ("cluster.trainer_nodes x cluster.trainer_gpus_per_node" if c.trainer_gpus_per_node
                    else "cluster.trainer_nodes x cluster.gpus_per_node")
            errors.append(
                f"trainer GPUs = {what} = {c.trainer_nodes} x {per_node} = {trainer_gpus}, but tensor x pipeline "
                f"x context x data parallel = {tp} x {pp} x {cp} x {dp} = {tp * pp * cp * dp}; make them equal "
                f"(e.g. parallel.data_parallel_size = {max(1, trainer_gpus // (tp * pp * cp))})")
        if c.trainer_gpus_per_node and c.trainer_gpus_per_node < c.gpus_per_node and c.rollout_nodes > 0:
            errors.append(f"cluster.trainer_gpus_per_node = {c.trainer_gpus_per_node} < cluster.gpus_per_node = "
                          f"{c.gpus_per_node} splits the trainer's nodes with the rollout servers, which needs "
                          f"cluster.rollout_nodes = 0 (not {c.rollout_nodes}); or set trainer_gpus_per_node = 0")
        shared = c.rollout_nodes == 0 and per_node < c.gpus_per_node
        if (c.rollout_nodes > 0 or shared) and cfg.rollout.engine == "sglang":
            per_server = cfg.rollout.tp_size * cfg.rollout.dp_size  # GPUs of one server
            free = c.gpus_per_node - per_node if shared else c.gpus_per_node  # rollout GPUs per node
            nodes = c.trainer_nodes if shared else c.rollout_nodes
            rollout_gpus = nodes * free
            if free % per_server:
                errors.append(f"rollout GPUs per node = {free} are not a multiple of "
                              f"rollout.tp_size x rollout.dp_size = {per_server}")
            elif not cfg.rollout.urls and cfg.rollout.num_servers * per_server > rollout_gpus:
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
    # A sequence longer than a micro-batch can never be trained on: the rollout runner drops it as too_long
    # (agents/runner.py), so every long response would be lost, a bias towards short answers.
    longest = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    if 0 < t.micro_batch_tokens < longest:  # a non-positive value is reported with the other counts
        errors.append(f"train.micro_batch_tokens = {t.micro_batch_tokens} is below the longest sequence, "
                      f"data.max_prompt_len {cfg.data.max_prompt_len} + rollout.max_new_tokens "
                      f"{cfg.rollout.max_new_tokens} = {longest}: such samples would be dropped, never trained on; "
                      f"raise train.micro_batch_tokens to at least {longest} (or lower the other two)")
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


def _check_model(cfg: DictConfig, errors: list[str], check_files: bool) -> None:
    if check_files and cfg.model.hf_path and not Path(os.path.expanduser(cfg.model.hf_path)).exists():
        errors.append(f"model.hf_path = {cfg.model.hf_path!r} does not exist; "
                      f"{missing_file_hint(cfg, 'model.hf_path', cfg.model.hf_path, 'HF checkpoint directory')}")
    try:
        hf = model_hf_config(cfg, check_files)
    except ConfigError as e:
        errors.append(str(e))
        return
    if hf is None:
        return
    from m2po_megatron.models.layout import layout_errors

    before = len(errors)
    p = cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    heads = hf.get("num_attention_heads")
    layers = hf.get("num_hidden_layers")
    experts, expert_ffn = moe_dims(hf)
    etp, ep = p.expert_tensor_parallel_size, p.expert_model_parallel_size  # < 1: reported in validate()
    errors += layout_errors(num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads") or heads,
                            num_layers=layers, intermediate_size=None if experts else hf.get("intermediate_size"),
                            vocab_size=hf.get("vocab_size"), tp=tp, pp=pp,
                            vpp=p.virtual_pipeline_model_parallel_size, prefix="parallel.",
                            num_experts=experts, moe_intermediate_size=expert_ffn,
                            ep=max(ep, 1), etp=etp if etp and etp > 0 else None,
                            world_size=_trainer_world(cfg))
    if experts and tp > 1 and not p.sequence_parallel:
        errors.append(f"parallel.sequence_parallel = false with tensor_model_parallel_size = {tp}: megatron-core "
                      f"trains a mixture-of-experts model with TP > 1 only under sequence parallelism; set "
                      f"parallel.sequence_parallel = true or use TP 1")
    if not experts and cfg.model.moe_grouped_gemm:
        errors.append(f"model.moe_grouped_gemm = true groups a mixture-of-experts model's experts; "
                      f"{_architecture(hf)} is dense: set it to false")
    if not experts and cfg.algo.routing_replay != "none":
        errors.append(f"algo.routing_replay = {cfg.algo.routing_replay} replays the experts of a mixture-of-experts "
                      f"model; {_architecture(hf)} is dense: use none")
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
        if cfg.cluster.colocate:  # both phases on a shared GPU, each named when it cannot fit
            from m2po_megatron.models.colocated_memory import colocated_from_config, phase_errors

            errors += phase_errors(colocated_from_config(cfg, hf, est))
        elif est["total"] > cfg.cluster.gpu_memory_gb:
            from m2po_megatron.models.memory import format_estimate

            errors.append(f"estimated trainer memory {est['total']:.1f} GiB per GPU exceeds cluster.gpu_memory_gb = "
                          f"{cfg.cluster.gpu_memory_gb}; raise tensor/pipeline parallel size or lower "
                          f"train.micro_batch_tokens ({format_estimate(est)})")


MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)  # models/hf_config.py reads these; other MoE configs fail there


def moe_dims(hf: dict) -> tuple[Optional[int], Optional[int]]:
    """(num_experts, moe_intermediate_size) of a mixture-of-experts config, (None, None) for a dense one. The
    dict is read as written (an unsupported model is reported by the memory estimate, which parses it fully);
    transformers 5 saves Qwen3-MoE's num_experts as num_local_experts."""
    archs = hf.get("architectures") or []
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    moe = any(a in MOE_ARCHITECTURES for a in archs) or (not archs and hf.get("model_type") == "qwen3_moe")
    if not (moe and experts):
        return None, None
    return int(experts), hf.get("moe_intermediate_size")


def _architecture(hf: dict) -> str:
    return ", ".join(hf.get("architectures") or []) or str(hf.get("model_type", "this model"))


def _trainer_world(cfg: DictConfig) -> int:
    """The trainer's ranks as the actor builds them (tp x pp x cp x dp): _check_layout already holds the
    cluster section to the same product, and on CPU (no cluster GPUs) it is the only count there is."""
    p = cfg.parallel
    return (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
            * p.data_parallel_size)


def estimate_memory(cfg: DictConfig, hf: Optional[dict] = None) -> Optional[dict]:
    """The per-GPU memory estimate of a trainer rank in GiB (m2po_megatron.models.memory), or None when the model's
    config.json is not known. A layout it cannot compute is a ConfigError naming the field."""
    hf = hf if hf is not None else model_hf_config(cfg)
    if hf is None:
        return None
    from m2po_megatron.models.memory import estimate_gpu_memory
    from m2po_megatron.models.reference_memory import recipe_reference

    p = cfg.parallel
    replay = cfg.algo.routing_replay
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
            attention_backend=_gpu_attention_backend(cfg.model.attention_backend),
            expert_model_parallel_size=p.expert_model_parallel_size,
            expert_tensor_parallel_size=p.expert_tensor_parallel_size,
            moe_aux_loss=(cfg.model.moe_aux_loss_coeff or 0) > 0,
            routing_replay=replay if replay in choices()["algo.routing_replay"] else "none",  # else reported
            **recipe_reference(cfg))
    except ValueError as e:
        raise ConfigError(f"memory estimate of this layout: {e} (parallel.*); use sizes that divide the model") from None


def _gpu_attention_backend(requested: str) -> str:
    """The backend a GPU trainer would build for `requested` ("auto": TE when this environment has it)."""
    if requested != "auto":
        return requested
    import importlib.util

    return "te" if importlib.util.find_spec("transformer_engine") is not None else "sdpa"


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

