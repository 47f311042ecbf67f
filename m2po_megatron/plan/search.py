"""Rank the layouts of a cluster for a recipe (plan/space.py) by predicted trained tokens per second, simulating
(plan/runs.py) only the layouts whose upper bound (plan/bound.py) can still reach the table; and find the
smallest cluster whose best layout comes within a few percent of the fastest, since a user pays per GPU."""
from __future__ import annotations

import time
from typing import Optional

from omegaconf import DictConfig

from m2po_megatron.plan.bound import margin, upper_bound
from m2po_megatron.plan.colocated import colocated
from m2po_megatron.plan.costs import Layout
from m2po_megatron.plan.hardware import GPUS
from m2po_megatron.plan.runs import (MEASURED_STEPS, Pool, generation_key, mean_of, separable, simulate_all,
                                     workers)
from m2po_megatron.plan.sim import LengthDist
from m2po_megatron.plan.space import (Candidate, Checker, allocations, check, layout_costs, layouts,
                                      spec_from_config, trainer_memory)

__all__ = ["Candidate", "WITHIN", "check", "plan", "separable"]

WITHIN = 5.0  # percent: the smallest cluster whose best layout is within this of the fastest is shown beside it


class _Context:
    """What every cluster size of one plan shares: the recipe, the model's shape, and memos of the memory
    estimates, specs and simulations (a trainer layout's memory does not depend on the split)."""

    def __init__(self, cfg: DictConfig, gpus_per_node: int, gpu: str, *, measured: int, seeds: int, seed: int,
                 response: Optional[LengthDist], prompt_len: Optional[int], efficiency: Optional[dict]):
        from m2po_megatron.config import model_hf_config
        from m2po_megatron.models.memory import model_shape, param_count

        self.cfg, self.gpus_per_node, self.gpu = cfg, gpus_per_node, gpu
        self.measured, self.seeds, self.seed = measured, seeds, seed
        self.response, self.prompt_len, self.efficiency = response, prompt_len, efficiency
        self.hf = model_hf_config(cfg)
        if self.hf is None:
            raise ValueError("the recipe's model has no config.json to size it from (model.hf_config or "
                             "model.hf_path)")
        self.mem_gb = round(GPUS[gpu].memory_gb * 1e9 / 2**30, 1)
        self.shape, self.params = model_shape(self.hf), param_count(self.hf)
        self.simulations: dict = {}  # runs.simulate_all's cache
        self.pool = Pool()
        self.check = Checker(cfg)
        self._memory: dict = {}
        self._specs: dict = {}

    def memory(self, lay: Layout) -> Optional[dict]:
        k = (lay.tp, lay.pp, lay.dp, lay.ep)
        if k not in self._memory:
            self._memory[k] = trainer_memory(self.cfg, self.hf, lay)
        return self._memory[k]

    def spec(self, num_servers: int, sync_interval):
        k = (num_servers, sync_interval)
        if k not in self._specs:
            self._specs[k] = spec_from_config(self.cfg, num_servers=num_servers, response=self.response,
                                              prompt_len=self.prompt_len, sync_interval=sync_interval)
        return self._specs[k]


def plan(cfg: DictConfig, gpus: int, gpus_per_node: int = 8, gpu: str = "h100", *, steps: Optional[int] = None,
         seeds: int = 3, top: int = 8, response: Optional[LengthDist] = None, prompt_len: Optional[int] = None,
         efficiency: Optional[dict] = None, seed: int = 0, exhaustive: bool = False,
         within: Optional[float] = None) -> dict:
    """{"ranked": [Candidate] best first, at most `top`, "all": every simulated Candidate, "layouts": n,
    "over_memory": n, "skipped": {error: n}, "classes": n, "simulated": n, "pruned": n, "colocated": Candidate
    or None, "smallest": see `smallest` (searched only when `within`, a percentage, is given: `m2po plan`
    gives WITHIN), "seconds": {phase: wall seconds}}.

    Every layout's memory is estimated. Layouts whose simulations are identical (same SimSpec and Costs: TP2 x
    DP16 and TP4 x DP8 cost the same in the model) form one class, shown once: by the member that passes the
    config's validation with the least memory. Classes are simulated in the order of their upper bound
    (plan/bound.py), each over `seeds` seeds of `steps` measured steps after the warm-up; once `top` rows are
    simulated, a class whose bound (raised by its sampling margin) is below the `top`-th best row's mean cannot
    enter the table and is pruned with all that follow (`exhaustive`: none is). The table's rows and ties are
    `_rank`'s."""
    if gpu not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is not one of {', '.join(GPUS)}")
    if gpus < 2 or (gpus >= gpus_per_node and gpus % gpus_per_node):
        raise ValueError(f"--gpus {gpus}: give at least 2, and whole nodes of --gpus-per-node {gpus_per_node}")
    if seeds < 1 or (steps is not None and steps < 1):
        raise ValueError(f"--seeds {seeds}, --steps {steps}: give at least 1 of each")
    if within is not None and not 0 <= within < 100:
        raise ValueError(f"--within {within}: give a percentage in [0, 100), e.g. 5")
    ctx = _Context(cfg, gpus_per_node, gpu, measured=steps or MEASURED_STEPS, seeds=seeds, seed=seed,
                   response=response, prompt_len=prompt_len, efficiency=efficiency)
    with ctx.pool:
        t0 = time.perf_counter()
        res = _search(ctx, gpus, top=top, exhaustive=exhaustive)
        t1 = time.perf_counter()
        res["colocated"] = colocated(cfg, gpus, gpus_per_node, gpu, seeds=seeds, measured=ctx.measured,
                                     response=response, prompt_len=prompt_len, efficiency=efficiency, seed=seed,
                                     pool=ctx.pool)
        t2 = time.perf_counter()
        res["smallest"] = smallest(ctx, gpus, res["ranked"], within) if within is not None else None
    res["seconds"] = {"search": t1 - t0, "colocated": t2 - t1, "smallest": time.perf_counter() - t2}
    return res


def smallest(ctx: _Context, gpus: int, ranked: list[Candidate], within: float) -> Optional[dict]:
    """{"candidate", "gpus", "within", "target_tokens_per_s", "sizes": cluster sizes searched, "simulated"}: the
    best layout of the smallest cluster (plan/space.allocations, then `gpus` itself) whose best mean throughput
    is at least (1 - within %) of the fastest's. Sizes are tried smallest first, each a search for its best
    row with the target as the floor, so a size whose every bound is below the target costs no simulation."""
    if not ranked:
        return None
    target = (1 - within / 100) * ranked[0].predicted["tokens_per_s"]
    simulated = 0
    sizes = allocations(gpus, ctx.gpus_per_node)
    for k, g in enumerate(sizes, 1):
        r = _search(ctx, g, top=1, exhaustive=False, floor=target)
        simulated += r["simulated"]
        if r["ranked"] and r["ranked"][0].predicted["tokens_per_s"] >= target:
            return {"candidate": r["ranked"][0], "gpus": g, "within": within, "target_tokens_per_s": target,
                    "sizes": k, "simulated": simulated}
    return {"candidate": ranked[0], "gpus": gpus, "within": within, "target_tokens_per_s": target,
            "sizes": len(sizes), "simulated": simulated}


def _classes(ctx: _Context, gpus: int) -> tuple[dict, int, int]:
    """({(spec, costs): [Candidate]}, layouts, over memory) of a cluster of `gpus`."""
    classes: dict = {}
    over = 0
    all_layouts = layouts(ctx.cfg, gpus, ctx.gpus_per_node)
    for lay, ov in all_layouts:
        est = ctx.memory(lay)
        if est is None or est["total"] > ctx.mem_gb:
            over += 1
            continue
        c = Candidate(lay, {**ov, "cluster.gpu_memory_gb": ctx.mem_gb}, est["total"])
        c.spec = ctx.spec(lay.num_servers, ov.get("staleness.sync_interval"))
        # on one node the servers share the trainer's node: the weights go over NVLink
        c.costs = layout_costs(ctx.cfg, ctx.shape, ctx.params, lay, ctx.gpu, c.spec, ctx.gpus_per_node,
                               ctx.efficiency, same_node_sync=gpus <= ctx.gpus_per_node)
        classes.setdefault((c.spec, c.costs), []).append(c)
    return classes, len(all_layouts), over


def _search(ctx: _Context, gpus: int, *, top: int, exhaustive: bool, floor: float = 0.0) -> dict:
    """The pruned search of one cluster size (plan's dict, without colocated and smallest). `floor`: a
    throughput no class below it is wanted at (its bound is compared with the larger of it and the top-th
    row's mean)."""
    classes, n_layouts, over = _classes(ctx, gpus)
    bounds = {k: upper_bound(k[0], k[1], ctx.measured) for k in classes}
    order = sorted(classes, key=lambda k: -bounds[k])
    skipped: dict = {}
    done: list[Candidate] = []
    pending: list[Candidate] = []
    pruned = 0
    cached = lambda c: all((generation_key(c.spec, c.costs), ctx.seed + s) in ctx.simulations  # noqa: E731
                           for s in range(ctx.seeds))

    def flush():
        keys = [(c.spec, c.costs) for c in pending]
        for c, runs in zip(pending, simulate_all(keys, ctx.measured, ctx.seed, ctx.seeds, ctx.simulations,
                                                 ctx.pool)):
            c.predicted.update(mean_of(runs))
            c.predicted["sync_s"] = c.costs.sync_s()
            done.append(c)
        pending.clear()

    for i, key in enumerate(order):
        rows = _row_best(done)  # the table shows rows, so a class must beat the top-th row to enter it
        kth = max(floor, sorted(rows, reverse=True)[top - 1] if len(rows) >= top else 0.0)
        if not exhaustive and bounds[key] * (1 + margin(key[0], ctx.measured, ctx.seeds)) < kth:
            pruned = len(order) - i  # the order is by bound: every class after this one is bounded lower
            break
        rep = _representative(ctx.check, classes[key], skipped)
        if rep is None:
            continue
        rep.predicted["bound_tokens_per_s"] = bounds[key]
        pending.append(rep)
        # simulate once the batch has a generation for each core; one already simulated costs nothing
        new = {generation_key(c.spec, c.costs) for c in pending if not cached(c)}
        if not new or len(new) >= workers():
            flush()
    flush()
    return {"ranked": _rank(done)[:top], "layouts": n_layouts, "over_memory": over, "skipped": skipped,
            "classes": len(classes), "simulated": len(done), "pruned": pruned, "all": done}


def _representative(check, members: list[Candidate], skipped: dict) -> Optional[Candidate]:
    """The member of a class of equal predictions that passes validation with the least memory (then the
    smaller trainer model-parallel group), the others that pass listed as its equals; None if none passes."""
    rep = None
    for c in sorted(members, key=lambda c: (c.memory_gb, c.layout.tp * c.layout.pp)):
        err = check(c.overrides)
        if err is not None:
            skipped[err] = skipped.get(err, 0) + 1
        elif rep is None:
            rep = c
        else:
            rep.equivalent.append(c)
    return rep


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
