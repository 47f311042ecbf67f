"""Enumerate the splits of a cluster for a recipe, keep those that pass the config's own validation and fit the
memory estimate, simulate them (plan/sim.py) and rank them by predicted trained tokens per second.

Splits: with two or more nodes, whole nodes train and whole nodes generate (cluster.trainer_nodes and
rollout_nodes); on one node, GPUs are split within it (cluster.trainer_gpus_per_node, the servers on the rest). Trainer layouts: TP and PP in {1, 2, 4, 8} (TP within a
node), DP the rest; a mixture-of-experts model adds expert parallelism EP (expert_sizes), with sequence
parallelism wherever TP > 1 (megatron-core needs it for MoE). Servers: rollout.tp_size in {1, 2, 4, 8} within a node, as many servers as fit. In
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


def _divides(n: int, k: int) -> bool:
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
                if not (_divides(gpus_per_node, tp) and _divides(heads, tp) and _divides(layers, pp)
                        and tg % (tp * pp) == 0):
                    continue
                for rtp in SIZES:
                    if not (_divides(gpus_per_node, rtp) and _divides(heads, rtp) and rg % rtp == 0):
                        continue
                    for ep in expert_sizes(hf, tg // pp):
                        lay = Layout(tp, pp, tg // (tp * pp), rtp, rg // rtp, ep)
                        for si in _sync_intervals(cfg):
                            ov = {"parallel.tensor_model_parallel_size": tp,
                                  "parallel.pipeline_model_parallel_size": pp, "parallel.data_parallel_size": lay.dp,
                                  "rollout.tp_size": rtp, "rollout.num_servers": lay.num_servers,
                                  "cluster.trainer_nodes": tn, "cluster.rollout_nodes": rn,
                                  "cluster.gpus_per_node": gpus_per_node}
                            if rn == 0:
                                ov["cluster.trainer_gpus_per_node"] = tg
                            if tp == 1:
                                ov["parallel.sequence_parallel"] = False
                            ov.update(_expert_overrides(hf, tp, ep))
                            if si is not None:
                                ov["staleness.sync_interval"] = si
                            out.append((lay, ov))
    return out


def _expert_overrides(hf: dict, tp: int, ep: int) -> dict:
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
         seeds: int = 3, top: int = 8, response: Optional[LengthDist] = None, prompt_len: Optional[int] = None,
         efficiency: Optional[dict] = None, seed: int = 0, exhaustive: bool = False) -> dict:
    """{"ranked": [Candidate] best first, at most `top`, "all": every simulated Candidate, "layouts": n,
    "over_memory": n, "skipped": {error: n}, "classes": n, "simulated": n, "pruned": n}.

    Every layout's memory is estimated. Layouts whose simulations are identical (same SimSpec and Costs: TP2 x
    DP16 and TP4 x DP8 cost the same in the model) form one class, shown once: by the member that passes the
    config's validation with the least memory. Classes are simulated in the order of their upper bound
    (plan/bound.py), each over `seeds` seeds of `steps` measured steps after the warm-up; once `top` are
    simulated, a class whose bound (raised by its sampling margin) is below the `top`-th best row's mean cannot
    enter the table and is pruned with all that follow (`exhaustive`: none is). The table's rows and ties are
    `_rank`'s."""
    from m2po_megatron.config import model_hf_config
    from m2po_megatron.models.memory import model_shape, param_count
    from m2po_megatron.plan.bound import margin, upper_bound
    from m2po_megatron.plan.colocated import colocated

    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is not one of {', '.join(GPUS)}")
    if gpus < 2 or (gpus >= gpus_per_node and gpus % gpus_per_node):
        raise ValueError(f"--gpus {gpus}: give at least 2, and whole nodes of --gpus-per-node {gpus_per_node}")
    if seeds < 1 or (steps is not None and steps < 1):
        raise ValueError(f"--seeds {seeds}, --steps {steps}: give at least 1 of each")
    hf = model_hf_config(cfg)
    base = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    mem_gb = round(GPUS[gpu].memory_gb * 1e9 / 2**30, 1)
    shape, params = model_shape(hf), param_count(hf)
    p = cfg.parallel
    measured = steps or MEASURED_STEPS
    classes: dict = {}
    over = 0
    all_layouts = layouts(cfg, gpus, gpus_per_node)
    for lay, ov in all_layouts:
        est = trainer_memory(cfg, hf, lay)
        if est is None or est["total"] > mem_gb:
            over += 1
            continue
        c = Candidate(lay, {**ov, "cluster.gpu_memory_gb": mem_gb}, est["total"])
        c.spec = spec_from_config(cfg, num_servers=lay.num_servers, response=response, prompt_len=prompt_len,
                                  sync_interval=ov.get("staleness.sync_interval"))
        # on one node the servers share the trainer's node: the weights go over NVLink
        c.costs = layout_costs(cfg, shape, params, lay, gpu, c.spec, gpus_per_node, efficiency,
                               same_node_sync=gpus <= gpus_per_node)
        classes.setdefault((c.spec, c.costs), []).append(c)
    bounds = {k: upper_bound(k[0], k[1], measured) for k in classes}
    order = sorted(classes, key=lambda k: -bounds[k])
    skipped: dict = {}
    done: list[Candidate] = []
    i, pruned = 0, 0
    workers = _workers()
    while i < len(order):
        rows = _row_best(done)  # the table shows rows, so a class must beat the top-th row to enter it
        kth = sorted(rows, reverse=True)[top - 1] if len(rows) >= top else 0.0
        if not exhaustive and bounds[order[i]] * (1 + margin(order[i][0], measured, seeds)) < kth:
            pruned = len(order) - i  # the order is by bound: every class after this one is bounded lower
            break
        batch = []
        while i < len(order) and len(batch) < workers:
            rep = _representative(base, classes[order[i]], skipped)
            if rep is not None:
                rep.predicted["bound_tokens_per_s"] = bounds[order[i]]
                batch.append(rep)
            i += 1
        for c, runs in zip(batch, _simulate_all([(c.spec, c.costs) for c in batch], measured, seed, seeds)):
            c.predicted.update(_mean_of(runs))
            c.predicted["sync_s"] = c.costs.sync_s()
            done.append(c)
    ranked = _rank(done)[:top]
    co = colocated(cfg, gpus, gpus_per_node, gpu, seeds=seeds, measured=measured, response=response,
                   prompt_len=prompt_len, efficiency=efficiency, seed=seed)
    return {"ranked": ranked, "colocated": co, "layouts": len(all_layouts), "over_memory": over, "skipped": skipped,
            "classes": len(classes), "simulated": len(done), "pruned": pruned, "all": done}


def trainer_memory(cfg: DictConfig, hf: dict, lay: Layout) -> Optional[dict]:
    """models/memory.py's estimate per trainer GPU of `lay` (GiB by part, "total"); None when it cannot be
    built (a layout the model's shape does not divide)."""
    from m2po_megatron.models.memory import estimate_gpu_memory

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
                                   **moe)
    except ValueError:
        return None


def layout_costs(cfg: DictConfig, shape, params: int, lay: Layout, gpu: str, spec: SimSpec, gpus_per_node: int,
                 efficiency: Optional[dict], *, same_node_sync: bool) -> Costs:
    """The hardware costs of `lay` for the recipe, its micro-batches per update counted from `spec`'s mean
    sequence (prompt plus the assumed mean response)."""
    ctx = spec.prompt_len + spec.response.mean
    tokens_update = spec.groups_per_step * spec.n * ctx / spec.updates_per_step
    mbs = max(1, math.ceil(tokens_update / lay.dp / cfg.train.micro_batch_tokens))
    return from_hardware(shape, params, lay, gpu, micro_batches=mbs, mean_context=ctx,
                         mem_fraction_static=cfg.rollout.mem_fraction_static, efficiency=efficiency,
                         same_node_sync=same_node_sync, fp8=bool(cfg.model.fp8), gpus_per_node=gpus_per_node,
                         use_distributed_optimizer=cfg.parallel.use_distributed_optimizer)


MEASURED_STEPS = 8  # per seed, after the warm-up: with 3 seeds, a mean over 24 steps


def _workers() -> int:
    import os

    return max(1, os.cpu_count() or 1)


def _representative(base: DictConfig, members: list[Candidate], skipped: dict) -> Optional[Candidate]:
    """The member of a class of equal predictions that passes validation with the least memory (then the
    smaller trainer model-parallel group), the others that pass listed as its equals; None if none passes."""
    rep = None
    for c in sorted(members, key=lambda c: (c.memory_gb, c.layout.tp * c.layout.pp)):
        err = check(base, c.overrides)
        if err is not None:
            skipped[err] = skipped.get(err, 0) + 1
        elif rep is None:
            rep = c
        else:
            rep.equivalent.append(c)
    return rep


def _mean_of(runs: list[dict]) -> dict:
    """The seeds' mean of each figure, and the spread of the throughput: its standard deviation over the seeds
    and the seeds' own values."""
    out = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0] if k != "staleness_max"}
    out["staleness_max"] = max(r["staleness_max"] for r in runs)
    tps = [r["tokens_per_s"] for r in runs]
    out["tokens_per_s_sd"] = (sum((t - out["tokens_per_s"]) ** 2 for t in tps) / (len(tps) - 1)) ** 0.5 \
        if len(tps) > 1 else 0.0
    out["tokens_per_s_seeds"] = tps
    return out


TIE = 0.01  # differences below 1 % are below what the model resolves: ties, whatever the seeds say


def separable(a: dict, b: dict) -> bool:
    """Whether two candidates' throughputs differ: by more than 1 %, and by more than two standard errors of
    their difference. The seeds are common to all candidates (the same seed draws the same lengths in the
    same order), so the difference is taken seed by seed: a paired comparison."""
    xs, ys = a["tokens_per_s_seeds"], b["tokens_per_s_seeds"]
    d = [x - y for x, y in zip(xs, ys)]
    mean = sum(d) / len(d)
    se = (sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5 if len(d) > 1 else 0.0
    return abs(mean) > max(2 * se, TIE * max(a["tokens_per_s"], b["tokens_per_s"]))


def _least_memory_of_ties(cands: list[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
    """(the candidates not separable from the best by mean, least memory first; the rest, best first)."""
    by_mean = sorted(cands, key=lambda c: -c.predicted["tokens_per_s"])
    best = by_mean[0].predicted
    tied = [c for c in by_mean if not separable(best, c.predicted)]
    ids = {id(c) for c in tied}
    tied.sort(key=lambda c: (c.memory_gb, c.layout.tp * c.layout.pp, -c.predicted["tokens_per_s"]))
    return tied, [c for c in by_mean if id(c) not in ids]


def _row_key(c: Candidate) -> tuple:
    lay = c.layout
    return lay.trainer_gpus, lay.rollout_tp, lay.num_servers, c.overrides.get("staleness.sync_interval")


def _row_best(done: list[Candidate]) -> list[float]:
    """The best mean tokens/s of each row of the table (a split, rollout layout and sync interval)."""
    best: dict = {}
    for c in done:
        k = _row_key(c)
        best[k] = max(best.get(k, 0.0), c.predicted["tokens_per_s"])
    return list(best.values())


def _rank(done: list[Candidate]) -> list[Candidate]:
    """One row per split of the cluster, rollout layout and sync interval: the trainer layouts of a row that
    are not separable from its best are one choice, shown by the one with the least memory, the others listed
    as its equals. Rows are ranked by mean tokens/s; those not separable from the best go first, least memory
    first, each marked `tied_with_best`."""
    rows: dict = {}
    for c in done:
        rows.setdefault(_row_key(c), []).append(c)
    reps = []
    for members in rows.values():
        tied, _ = _least_memory_of_ties(members)
        rep = tied[0]
        rep.equivalent += [e for c in tied[1:] for e in (c, *c.equivalent)]
        reps.append(rep)
    if not reps:
        return []
    tied, rest = _least_memory_of_ties(reps)
    for c in reps:
        c.predicted["tied_with_best"] = len(tied) > 1 and any(c is t for t in tied)
    return tied + rest


def _simulate_all(keys: list, measured: int, seed: int, seeds: int) -> list[list[dict]]:
    """For each (spec, costs), its simulation at each of `seeds` seeds (seed, seed + 1, ...), over the machine's
    cores (forked workers; serially where fork is not available): the simulations are independent and each is
    pure Python."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(sp, c, measured, seed + k) for sp, c in keys for k in range(seeds)]
    workers = min(len(jobs), _workers())
    if workers > 1 and "fork" in multiprocessing.get_all_start_methods():
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            flat = list(pool.map(_simulate_job, jobs))
    else:
        flat = [_simulate_job(j) for j in jobs]
    return [flat[k * seeds:(k + 1) * seeds] for k in range(len(keys))]


def _simulate_job(job: tuple) -> dict:
    return _simulate(*job)


def _simulate(sp: SimSpec, costs: Costs, measured: int, seed: int) -> dict:
    """The simulated summary of `measured` steps after the warm-up: in bounded mode the steps that fill the
    window, in the synchronous modes the first step. fixed_lag's timing does not depend on the lag (it only
    delays which batch is trained), so it runs with a lag of 1 and reports the recipe's steady-state
    staleness, lag x U, which is what FixedLagQueue gives once warm; this keeps a lag of 64 from simulating 64
    warm-up generations."""
    lag = sp.lag_steps
    if sp.mode == "fixed_lag":
        sp = replace(sp, lag_steps=min(lag, 1))
    skip = math.ceil(sp.max_staleness / sp.updates_per_step) + 1 if sp.mode == "bounded" else 1
    out = simulate(sp, costs, steps=skip + measured, seed=seed, skip=skip).summary()
    if sp.mode == "fixed_lag":
        out["staleness_mean"] = out["staleness_max"] = lag * sp.updates_per_step
    return out
