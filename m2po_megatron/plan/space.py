"""The layouts `m2po plan` considers for a recipe on a cluster, and what each needs priced: its recipe
overrides, the config's own validation, the trainer's memory estimate, its SimSpec and its Costs.

Splits: with two or more nodes, whole nodes train and whole nodes generate (cluster.trainer_nodes and
rollout_nodes); on one node, GPUs are split within it (cluster.trainer_gpus_per_node, the servers on the rest).
Trainer layouts: TP and PP in {1, 2, 4, 8} (TP within a node), DP the rest; a mixture-of-experts model adds
expert parallelism EP (expert_sizes), with sequence parallelism wherever TP > 1 (megatron-core needs it for
MoE). Servers: rollout.tp_size in {1, 2, 4, 8} within a node, as many servers as fit. In bounded mode,
staleness.sync_interval takes each multiple of updates_per_step the controller accepts; the staleness window
itself is the recipe's (it is part of the algorithm, not of the layout)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from m2po_megatron.plan.costs import Costs, Layout, from_hardware
from m2po_megatron.plan.sim import LengthDist, SimSpec

__all__ = ["SIZES", "Candidate", "Checker", "allocations", "check", "divides", "expert_overrides", "expert_sizes",
           "layout_costs", "layouts", "spec_from_config", "sync_intervals", "trainer_memory"]

SIZES = (1, 2, 4, 8)


@dataclass
class Candidate:
    layout: Layout
    overrides: dict  # dotted key -> value, on top of the recipe
    memory_gb: float
    costs: Optional[Costs] = None
    spec: Optional[SimSpec] = None
    predicted: dict = field(default_factory=dict)  # SimResult.summary(), the seeds' mean, and its spread
    equivalent: list = field(default_factory=list)  # other valid layouts of the same prediction

    def dotted(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.overrides.items()]


def spec_from_config(cfg: DictConfig, *, num_servers: int, response: Optional[LengthDist] = None,
                     prompt_len: Optional[int] = None, accuracy: float = 0.5, sync_interval=None) -> SimSpec:
    """The SimSpec of a recipe. Response lengths default to a gamma of mean max_new_tokens / 3 and cv 0.6, and
    prompts to half of data.max_prompt_len: assumptions, unless `response` and `prompt_len` are given."""
    r, s, t = cfg.rollout, cfg.staleness, cfg.train
    resp = response or LengthDist(r.max_new_tokens / 3, 0.6, r.max_new_tokens)
    lp = (s.behav_logprob_source == "trainer" and s.mode == "bounded") or cfg.algo.rollout_correction.mode != "bypass" \
        or (cfg.algo.name == "m2po" and cfg.algo.m2po.scope == "global")
    return SimSpec(mode=s.mode, groups_per_step=t.prompts_per_step, n=r.n_samples_per_prompt,
                   updates_per_step=t.updates_per_step, prompt_len=prompt_len or max(1, cfg.data.max_prompt_len // 2),
                   response=resp, num_servers=num_servers, max_staleness=s.max_staleness,
                   sync_interval=sync_interval if sync_interval is not None else s.sync_interval,
                   lag_steps=s.lag_steps, max_concurrency=r.max_concurrency, logprob_pass=lp,
                   recompute_behaviour=s.behav_logprob_source == "trainer" and s.mode != "bounded",
                   max_gen_batches=t.filter_groups.max_num_gen_batches if t.filter_groups.enable else None,
                   accuracy=accuracy)


def divides(n: int, k: int) -> bool:
    return k <= n and n % k == 0


def expert_sizes(hf: dict, stage_ranks: int) -> list[int]:
    """The expert-parallel sizes to try: [1] for a dense model; for a MoE model every divisor of num_experts that
    divides the ranks of a pipeline stage. Expert tensor parallel stays 1: megatron-core's guidance for
    fine-grained experts (Qwen3-30B-A3B's 768-wide experts would make thin GEMMs split further, and ETP 1
    spares the experts the tensor-parallel all-gather), so EP alone divides the experts."""
    from m2po_megatron.config.validation import moe_dims

    experts, _ = moe_dims(hf)
    if not experts:
        return [1]
    return [e for e in range(1, experts + 1) if experts % e == 0 and stage_ranks % e == 0]


def layouts(cfg: DictConfig, gpus: int, gpus_per_node: int) -> list[tuple[Layout, dict]]:
    """Every split and layout of `gpus` with its recipe overrides (not yet validated)."""
    from m2po_megatron.config import model_hf_config

    hf = model_hf_config(cfg)
    if hf is None:
        raise ValueError("the recipe's model has no config.json to size it from (model.hf_config or model.hf_path)")
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    nodes = gpus // gpus_per_node
    if nodes >= 2:
        splits = [(t * gpus_per_node, (nodes - t) * gpus_per_node, t, nodes - t) for t in range(1, nodes)]
    else:  # one node split between the two (cluster.trainer_gpus_per_node, the servers on the rest)
        gpus_per_node = gpus
        splits = [(t, gpus - t, 1, 0) for t in range(1, gpus)]
    out = []
    for tg, rg, tn, rn in splits:
        for tp in SIZES:
            for pp in SIZES:
                if not (divides(gpus_per_node, tp) and divides(heads, tp) and divides(layers, pp)
                        and tg % (tp * pp) == 0):
                    continue
                for rtp in SIZES:
                    if not (divides(gpus_per_node, rtp) and divides(heads, rtp) and rg % rtp == 0):
                        continue
                    for ep in expert_sizes(hf, tg // pp):
                        lay = Layout(tp, pp, tg // (tp * pp), rtp, rg // rtp, ep)
                        for si in sync_intervals(cfg):
                            ov = {"parallel.tensor_model_parallel_size": tp,
                                  "parallel.pipeline_model_parallel_size": pp, "parallel.data_parallel_size": lay.dp,
                                  "rollout.tp_size": rtp, "rollout.num_servers": lay.num_servers,
                                  "cluster.trainer_nodes": tn, "cluster.rollout_nodes": rn,
                                  "cluster.gpus_per_node": gpus_per_node}
                            if rn == 0:
                                ov["cluster.trainer_gpus_per_node"] = tg
                            if tp == 1:
                                ov["parallel.sequence_parallel"] = False
                            ov.update(expert_overrides(hf, tp, ep))
                            if si is not None:
                                ov["staleness.sync_interval"] = si
                            out.append((lay, ov))
    return out


def expert_overrides(hf: dict, tp: int, ep: int) -> dict:
    """A MoE layout's expert settings (EP, ETP 1, sequence parallelism at TP > 1); nothing for a dense model."""
    from m2po_megatron.config.validation import moe_dims

    if not moe_dims(hf)[0]:
        return {}
    return {"parallel.expert_model_parallel_size": ep, "parallel.expert_tensor_parallel_size": 1,
            "parallel.sequence_parallel": tp > 1}


def check(cfg: DictConfig, overrides: dict) -> Optional[str]:
    """None when the recipe with `overrides` passes the config's validation (what `m2po config` runs, memory
    estimate included), else its first error, whole (the field and the fix; not the "invalid config:" head)."""
    from m2po_megatron.config import ConfigError, validate

    c = OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))
    try:
        validate(c, check_files=False)
    except ConfigError as e:
        return _first_error(e)
    return None


def _first_error(e: Exception) -> str:
    lines = [ln.strip().removeprefix("- ") for ln in str(e).splitlines()]
    return next((ln for ln in lines if ln and ln != "invalid config:"), str(e))


class Checker:
    """`check` for many override sets of one recipe: each is set on one resolved copy of it, validated, and
    taken back, which spares a merge (a deep copy of the whole config, most of check's time) per layout."""

    def __init__(self, cfg: DictConfig):
        self.cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))

    def __call__(self, overrides: dict) -> Optional[str]:
        from m2po_megatron.config import ConfigError, validate

        missing = object()
        old = {k: OmegaConf.select(self.cfg, k, default=missing) for k in overrides}
        try:
            for k, v in overrides.items():
                OmegaConf.update(self.cfg, k, v, merge=False)
            validate(self.cfg, check_files=False)
        except ConfigError as e:
            return _first_error(e)
        finally:
            for k, v in old.items():
                if v is missing:
                    *parent, leaf = k.split(".")
                    del OmegaConf.select(self.cfg, ".".join(parent))[leaf]
                else:
                    OmegaConf.update(self.cfg, k, v, merge=False)
        return None


def sync_intervals(cfg: DictConfig) -> list[Optional[int]]:
    s, U = cfg.staleness, cfg.train.updates_per_step
    if s.mode != "bounded":
        return [None]
    top = max(1, s.max_staleness)
    return sorted({U * k for k in range(1, top // U + 1)} | {s.sync_interval}) if top >= U else [s.sync_interval]


def trainer_memory(cfg: DictConfig, hf: dict, lay: Layout) -> Optional[dict]:
    """models/memory.py's estimate per trainer GPU of `lay` (GiB by part, "total"); None when it cannot be
    built (a layout the model's shape does not divide)."""
    from m2po_megatron.models.memory import estimate_gpu_memory
    from m2po_megatron.models.reference_memory import recipe_reference

    from m2po_megatron.config.validation import moe_dims

    p = cfg.parallel
    moe = {}
    sp = p.sequence_parallel and lay.tp > 1
    if moe_dims(hf)[0]:  # the layout's expert settings (_expert_overrides)
        sp = lay.tp > 1
        moe = dict(expert_model_parallel_size=lay.ep, expert_tensor_parallel_size=1,
                   moe_aux_loss=cfg.model.moe_aux_loss_coeff > 0, routing_replay=cfg.algo.routing_replay)
    try:
        return estimate_gpu_memory(hf, micro_batch_tokens=cfg.train.micro_batch_tokens,
                                   tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
                                   data_parallel_size=lay.dp, use_distributed_optimizer=p.use_distributed_optimizer,
                                   params_dtype="bf16" if cfg.model.params_dtype == "auto" else cfg.model.params_dtype,
                                   fp8=bool(cfg.model.fp8), sequence_parallel=sp,
                                   recompute=p.recompute_granularity, context_parallel_size=p.context_parallel_size,
                                   **moe, **recipe_reference(cfg))
    except ValueError:
        return None


def layout_costs(cfg: DictConfig, shape, params: int, lay: Layout, gpu: str, spec: SimSpec, gpus_per_node: int,
                 efficiency: Optional[dict], *, same_node_sync: bool) -> Costs:
    """The hardware costs of `lay` for the recipe, its micro-batches per update counted from `spec`'s mean
    sequence (prompt plus the assumed mean response)."""
    from m2po_megatron.models.reference_memory import reference_place

    ctx = spec.prompt_len + spec.response.mean
    tokens_update = spec.groups_per_step * spec.n * ctx / spec.updates_per_step
    mbs = max(1, math.ceil(tokens_update / lay.dp / cfg.train.micro_batch_tokens))
    return from_hardware(shape, params, lay, gpu, micro_batches=mbs, mean_context=ctx,
                         mem_fraction_static=cfg.rollout.mem_fraction_static, efficiency=efficiency,
                         same_node_sync=same_node_sync, fp8=bool(cfg.model.fp8), gpus_per_node=gpus_per_node,
                         use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
                         reference=reference_place(cfg))


def allocations(gpus: int, gpus_per_node: int) -> list[int]:
    """The cluster sizes below `gpus` a plan can use, smallest first: 2 up to a node's GPUs on one node, then
    whole nodes."""
    one_node = list(range(2, min(gpus, gpus_per_node + 1)))
    return one_node + [n * gpus_per_node for n in range(2, gpus // gpus_per_node) if n * gpus_per_node < gpus]
