"""Enumerate the splits of a cluster for a recipe, keep those that pass the config's own validation and fit the
memory estimate, simulate them (plan/sim.py) and rank them by predicted trained tokens per second.

Splits: with two or more nodes, whole nodes train and whole nodes generate (cluster.trainer_nodes and
rollout_nodes); on one node, GPUs are split within it. Trainer layouts: TP and PP in {1, 2, 4, 8} (TP within a
node), DP the rest. Servers: rollout.tp_size in {1, 2, 4, 8} within a node, as many servers as fit. In
bounded mode, staleness.sync_interval takes each multiple of updates_per_step the controller accepts; the
staleness window itself is the recipe's (it is part of the algorithm, not of the layout)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from m2po_megatron.plan.costs import Costs, Layout, from_hardware
from m2po_megatron.plan.hardware import GPUS
from m2po_megatron.plan.sim import LengthDist, SimSpec, simulate

__all__ = ["Candidate", "check", "layouts", "plan", "spec_from_config"]

SIZES = (1, 2, 4, 8)


@dataclass
class Candidate:
    layout: Layout
    overrides: dict  # dotted key -> value, on top of the recipe
    memory_gb: float
    costs: Optional[Costs] = None
    spec: Optional[SimSpec] = None
    predicted: dict = field(default_factory=dict)  # SimResult.summary()

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


def _divides(n: int, k: int) -> bool:
    return k <= n and n % k == 0


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
    else:
        splits = [(t, gpus - t, 1, 0) for t in range(1, gpus)]
    out = []
    for tg, rg, tn, rn in splits:
        for tp in SIZES:
            for pp in SIZES:
                if not (_divides(gpus_per_node, tp) and _divides(heads, tp) and _divides(layers, pp)
                        and tg % (tp * pp) == 0):
                    continue
                for rtp in SIZES:
                    if not (_divides(gpus_per_node, rtp) and _divides(heads, rtp) and rg >= rtp):
                        continue
                    lay = Layout(tp, pp, tg // (tp * pp), rtp, rg // rtp)
                    for si in _sync_intervals(cfg):
                        ov = {"parallel.tensor_model_parallel_size": tp, "parallel.pipeline_model_parallel_size": pp,
                              "parallel.data_parallel_size": lay.dp, "rollout.tp_size": rtp,
                              "rollout.num_servers": lay.num_servers, "cluster.trainer_nodes": tn,
                              "cluster.rollout_nodes": rn, "cluster.gpus_per_node": gpus_per_node}
                        if tp == 1:
                            ov["parallel.sequence_parallel"] = False
                        if si is not None:
                            ov["staleness.sync_interval"] = si
                        out.append((lay, ov))
    return out


def check(cfg: DictConfig, overrides: dict) -> Optional[str]:
    """None when the recipe with `overrides` passes the config's validation (what `m2po config` runs, memory
    estimate included), else its first error, whole (the field and the fix; not the "invalid config:" head)."""
    from m2po_megatron.config import ConfigError, validate

    c = OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))
    try:
        validate(c, check_files=False)
    except ConfigError as e:
        lines = [ln.strip().removeprefix("- ") for ln in str(e).splitlines()]
        return next((ln for ln in lines if ln and ln != "invalid config:"), str(e))
    return None


def _sync_intervals(cfg: DictConfig) -> list[Optional[int]]:
    s, U = cfg.staleness, cfg.train.updates_per_step
    if s.mode != "bounded":
        return [None]
    top = max(1, s.max_staleness)
    return sorted({U * k for k in range(1, top // U + 1)} | {s.sync_interval}) if top >= U else [s.sync_interval]


def plan(cfg: DictConfig, gpus: int, gpus_per_node: int = 8, gpu: str = "h100", *, steps: Optional[int] = None,
         top: int = 8, response: Optional[LengthDist] = None, prompt_len: Optional[int] = None,
         efficiency: Optional[dict] = None, seed: int = 0) -> dict:
    """{"ranked": [Candidate] best first (simulated), "layouts": n, "over_memory": n, "skipped": {error: n},
    "unchecked": n}. Every layout's memory is estimated; those that fit are ordered by a steady-state bound
    (the slower of generation and training per step, or their sum in the synchronous modes), the best of each
    trainer/rollout split first; in that order each is checked against the config's validation until `top`
    pass, and those are simulated and ranked by predicted tokens/s."""
    from m2po_megatron.config import model_hf_config
    from m2po_megatron.models.memory import estimate_gpu_memory, model_shape, param_count

    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is not one of {', '.join(GPUS)}")
    if gpus < 2 or (gpus >= gpus_per_node and gpus % gpus_per_node):
        raise ValueError(f"--gpus {gpus}: give at least 2, and whole nodes of --gpus-per-node {gpus_per_node}")
    hf = model_hf_config(cfg)
    base = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    mem_gb = round(GPUS[gpu].memory_gb * 1e9 / 2**30, 1)
    shape, params = model_shape(hf), param_count(hf)
    p = cfg.parallel
    dtype = "bf16" if cfg.model.params_dtype == "auto" else cfg.model.params_dtype
    found, over = [], 0
    all_layouts = layouts(cfg, gpus, gpus_per_node)
    for lay, ov in all_layouts:
        try:
            est = estimate_gpu_memory(hf, micro_batch_tokens=cfg.train.micro_batch_tokens,
                                      tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
                                      data_parallel_size=lay.dp, use_distributed_optimizer=p.use_distributed_optimizer,
                                      params_dtype=dtype, fp8=bool(cfg.model.fp8),
                                      sequence_parallel=p.sequence_parallel and lay.tp > 1,
                                      recompute=p.recompute_granularity, context_parallel_size=p.context_parallel_size)
        except ValueError:
            over += 1
            continue
        if est["total"] > mem_gb:
            over += 1
            continue
        c = Candidate(lay, {**ov, "cluster.gpu_memory_gb": mem_gb}, est["total"])
        c.spec = spec_from_config(cfg, num_servers=lay.num_servers, response=response, prompt_len=prompt_len,
                                  sync_interval=ov.get("staleness.sync_interval"))
        ctx = c.spec.prompt_len + c.spec.response.mean
        tokens_update = c.spec.groups_per_step * c.spec.n * ctx / c.spec.updates_per_step
        mbs = max(1, math.ceil(tokens_update / lay.dp / cfg.train.micro_batch_tokens))
        c.costs = from_hardware(shape, params, lay, gpu, micro_batches=mbs, mean_context=ctx,
                                mem_fraction_static=cfg.rollout.mem_fraction_static, efficiency=efficiency)
        c.predicted = {"bound_step_s": _bound(c.spec, c.costs)}
        found.append(c)
    # the quick bound misjudges long-tailed lengths (the tail decodes at a small batch), so every split of
    # the cluster gets its best layout simulated first, then the rest in the bound's order
    found.sort(key=lambda c: c.predicted["bound_step_s"])
    firsts = {}
    for c in found:
        firsts.setdefault(c.layout.trainer_gpus, c)
    lead = set(map(id, firsts.values()))
    found = list(firsts.values()) + [c for c in found if id(c) not in lead]
    ranked, skipped, checked = [], {}, 0
    for c in found:
        if len(ranked) >= top:
            break
        checked += 1
        err = check(base, c.overrides)
        if err is not None:
            skipped[err] = skipped.get(err, 0) + 1
            continue
        ranked.append(c)
    # layouts that differ only where the costs do not (TP2xDP16 and TP4xDP8) simulate once
    keys = list(dict.fromkeys((c.spec, c.costs) for c in ranked))
    done = dict(zip(keys, _simulate_all(keys, steps, seed)))
    for c in ranked:
        c.predicted.update(done[(c.spec, c.costs)])
        c.predicted["sync_s"] = c.costs.sync_s()
    # predictions equal to three significant figures go to the smaller trainer model-parallel group: less
    # communication, which the trainer's cost model does not see
    ranked.sort(key=lambda c: (-float(f"{c.predicted['tokens_per_s']:.3g}"), c.layout.tp * c.layout.pp, c.memory_gb))
    return {"ranked": ranked, "layouts": len(all_layouts), "over_memory": over, "skipped": skipped,
            "unchecked": len(found) - checked}


def _simulate_all(keys: list, steps: Optional[int], seed: int) -> list[dict]:
    """_simulate for each (spec, costs), over the machine's cores (forked workers; serially where fork is not
    available): the simulations are independent and each is pure Python."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(sp, c, steps, seed) for sp, c in keys]
    workers = min(len(jobs), os.cpu_count() or 1)
    if workers > 1 and "fork" in multiprocessing.get_all_start_methods():
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(_simulate_job, jobs))
    return [_simulate_job(j) for j in jobs]


def _simulate_job(job: tuple) -> dict:
    return _simulate(*job)


def _simulate(sp: SimSpec, costs: Costs, steps: Optional[int], seed: int) -> dict:
    """The simulated summary. fixed_lag's timing does not depend on the lag (it only delays which batch is
    trained), so it runs with a lag of 1 and reports the recipe's steady-state staleness, lag x U, which is
    what FixedLagQueue gives once warm; this keeps a lag of 64 from simulating 64 warm-up generations."""
    lag = sp.lag_steps
    if sp.mode == "fixed_lag":
        sp = replace(sp, lag_steps=min(lag, 1))
    # bounded: the steps that fill the window (which simulate() leaves out) and four in the steady state
    n = steps or (math.ceil(sp.max_staleness / sp.updates_per_step) + 1 + 4 if sp.mode == "bounded" else 5)
    out = simulate(sp, costs, steps=n, seed=seed).summary()
    if sp.mode == "fixed_lag":
        out["staleness_mean"] = out["staleness_max"] = lag * sp.updates_per_step
    return out


def _bound(sp: SimSpec, c: Costs) -> float:
    """A quick per-step time: generation of a step's samples on the servers (in waves of max_running at the
    mean length) against training; summed in the synchronous modes, the larger in bounded."""
    per_server = sp.groups_per_step * sp.n / sp.num_servers
    batch = min(per_server, c.max_running)
    waves = math.ceil(per_server / batch)
    L = sp.response.mean
    gen = waves * (c.decode_s(L, int(batch), batch * sp.prompt_len) + batch * sp.prompt_len * c.prefill_per_token_s)
    train = c.train_s(sp.groups_per_step * sp.n * (sp.prompt_len + L), sp.updates_per_step, sp.logprob_pass)
    return max(gen, train) if sp.mode == "bounded" else gen + train + c.sync_s()
