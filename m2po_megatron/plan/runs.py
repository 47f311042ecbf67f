"""Running the simulations a plan needs: each (SimSpec, Costs) at several seeds, in forked workers, once.

**Shared generation.** In the synchronous modes (on_policy, fixed_lag) on dedicated devices (Costs.shared_cores
0) the servers generate only while the trainer waits: a step generates its batch (the trainer's log-prob pass
follows it), then trains, pushes the weights and does the loop's work, while the servers hold nothing. The
generation (its lengths, rewards, decode steps and busy time) is then the same whatever the trainer's figures
are; they only set how long each step's trainer parts take. Trainer layouts of one split and rollout layout
differ only there, so they share one simulation of their generation (`generation_key`, simulated with the
trainer's figures at zero) and each gets its own steps by `retime`: the same as simulating it, up to the
rounding of the clock's sums (tests/plan/test_runs.py). `bounded` overlaps the two, so each of its layouts is
simulated on its own."""
from __future__ import annotations

import math
import os
from dataclasses import replace

from m2po_megatron.plan.costs import Costs
from m2po_megatron.plan.sim import SimResult, SimSpec, simulate

__all__ = ["MEASURED_STEPS", "Pool", "TIE", "generation_key", "mean_of", "retime", "run_one", "separable",
           "simulate_all", "summarize", "workers"]

MEASURED_STEPS = 8  # per seed, after the warm-up: with 3 seeds, a mean over 24 steps
TIE = 0.01  # differences below 1 % are below what the model resolves: ties, whatever the seeds say
# the figures of the trainer's own work: what `retime` replaces
_TRAINER = {"train_fixed_s": 0.0, "train_per_update_s": 0.0, "train_per_token_s": 0.0, "logprob_per_token_s": 0.0,
            "loop_fixed_s": 0.0, "source": ""}


def workers() -> int:
    return max(1, os.cpu_count() or 1)


def generation_key(spec: SimSpec, costs: Costs) -> tuple[SimSpec, Costs]:
    """The (spec, costs) whose simulation `retime` turns into this one's: the trainer's figures at zero in the
    synchronous modes on dedicated devices; itself otherwise."""
    if spec.mode == "bounded" or costs.shared_cores:
        return spec, costs
    return spec, replace(costs, **_TRAINER)


def retime(res: SimResult, spec: SimSpec, costs: Costs) -> SimResult:
    """`res`, a synchronous simulation of generation_key(spec, costs), with each step's trainer parts at
    `costs`: the log-prob pass inside the wait, training and the loop's work (the weight push is the key's)."""
    rows, t = [], 0.0
    for r in res.steps:
        recompute = r["recompute_tokens"] * costs.logprob_per_token_s
        wait = r["wait_s"] - r["recompute_s"] + recompute
        train = costs.train_s(r["tokens"], spec.updates_per_step, spec.logprob_pass)
        step = wait + train + r["sync_s"] + costs.loop_fixed_s
        t += step
        rows.append({**r, "t_end": t, "step_s": step, "wait_s": wait, "train_s": train, "recompute_s": recompute})
    return SimResult(rows, res.server_busy_s, t, res.skip)


def run_one(sp: SimSpec, costs: Costs, measured: int, seed: int) -> SimResult:
    """`measured` steps after the warm-up: in bounded mode the steps that fill the window, in the synchronous
    modes the first step. fixed_lag's timing does not depend on the lag (it only delays which batch is
    trained), so it runs with a lag of 1 (`summarize` reports the recipe's staleness); this keeps a lag of 64
    from simulating 64 warm-up generations."""
    if sp.mode == "fixed_lag":
        sp = replace(sp, lag_steps=min(sp.lag_steps, 1))
    skip = math.ceil(sp.max_staleness / sp.updates_per_step) + 1 if sp.mode == "bounded" else 1
    return simulate(sp, costs, steps=skip + measured, seed=seed, skip=skip)


def summarize(sp: SimSpec, res: SimResult) -> dict:
    """The summary of a run_one result; fixed_lag reports lag x U, what FixedLagQueue gives once warm."""
    out = res.summary()
    if sp.mode == "fixed_lag":
        out["staleness_mean"] = out["staleness_max"] = sp.lag_steps * sp.updates_per_step
    return out


def _job(job: tuple) -> SimResult:
    return run_one(*job)


def simulate_all(keys: list, measured: int, seed: int, seeds: int, cache: dict | None = None,
                 pool=None) -> list[list[dict]]:
    """For each (spec, costs), its summary at each of `seeds` seeds (seed, seed + 1, ...). Each distinct
    generation is simulated once (and not again if `cache`, {(generation key, seed): SimResult}, holds it),
    over the machine's cores: in `pool` (a `Pool`), else in forked workers of its own (serially where fork is
    not available); the simulations are independent and each is pure Python."""
    cache = {} if cache is None else cache
    gkeys = [generation_key(sp, c) for sp, c in keys]
    todo = list(dict.fromkeys((g, seed + k) for g in gkeys for k in range(seeds) if (g, seed + k) not in cache))
    jobs = [(g[0], g[1], measured, s) for g, s in todo]
    if pool is not None:
        done = pool.map(jobs)
    else:
        with Pool() as own:
            done = own.map(jobs)
    cache.update(zip(todo, done))
    out = []
    for (sp, c), g in zip(keys, gkeys):
        runs = [cache[(g, seed + k)] for k in range(seeds)]
        if g[1] is not c:
            runs = [retime(r, sp, c) for r in runs]
        out.append([summarize(sp, r) for r in runs])
    return out


class Pool:
    """Forked workers, one per core, started at the first batch of two or more simulations and kept for the
    plan's later batches (a fork of the planner's process costs tenths of a second); serial where fork is not
    available."""

    def __init__(self):
        self._pool = None

    def map(self, jobs: list) -> list:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        if len(jobs) < 2 or workers() < 2 or "fork" not in multiprocessing.get_all_start_methods():
            return [_job(j) for j in jobs]
        if self._pool is None:
            self._pool = ProcessPoolExecutor(workers(), mp_context=multiprocessing.get_context("fork"))
        return list(self._pool.map(_job, jobs))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def mean_of(runs: list[dict]) -> dict:
    """The seeds' mean of each figure, and the spread of the throughput: its standard deviation over the seeds
    and the seeds' own values."""
    out = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0] if k != "staleness_max"}
    out["staleness_max"] = max(r["staleness_max"] for r in runs)
    tps = [r["tokens_per_s"] for r in runs]
    out["tokens_per_s_sd"] = (sum((t - out["tokens_per_s"]) ** 2 for t in tps) / (len(tps) - 1)) ** 0.5 \
        if len(tps) > 1 else 0.0
    out["tokens_per_s_seeds"] = tps
    return out


def separable(a: dict, b: dict) -> bool:
    """Whether two candidates' throughputs differ: by more than 1 %, and by more than two standard errors of
    their difference. The seeds are common to all candidates (the same seed draws the same lengths in the
    same order), so the difference is taken seed by seed: a paired comparison."""
    xs, ys = a["tokens_per_s_seeds"], b["tokens_per_s_seeds"]
    d = [x - y for x, y in zip(xs, ys)]
    mean = sum(d) / len(d)
    se = (sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5 if len(d) > 1 else 0.0
    return abs(mean) > max(2 * se, TIE * max(a["tokens_per_s"], b["tokens_per_s"]))
