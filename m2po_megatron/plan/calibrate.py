"""Fit the simulator's costs on a finished run (`m2po plan --calibrate RUN_DIR`), and say what a run measured.

From the run's timeline (trace.json) and metrics:
- **Rollout server**: every decode step of the CPU engine is a span with its batch size B and KV tokens K, so
  `decode_fixed_s + B x decode_per_seq_s + K x decode_per_kv_s` is a least-squares fit (relative residuals,
  non-negative terms); prefill spans give seconds per prompt token. A run on SGLang has no engine spans; its
  decode figures stay the datasheet's (`has_engine` says which).
- **Contention** (a host whose cores the trainer and the servers share): while the trainer computes, a decode
  step takes longer, and the other way round. A span's work is the integral of Costs.speed(1 + others busy)
  over it, and `contention` is the value under which both the decode fit and the trainer's per-token phases
  (work proportional to tokens) fit best (a grid over [0, 2]); every other figure is then taken as work, not
  wall time, so it does not carry the overlap of the run it came from.
- **Trainer**: the rank's per-update phases: `forward_backward` and `logprob_pass` over the step's tokens
  give seconds per token, `optimizer` seconds per update, and the rest of the loop's `train_step` span (the
  Ray call, packing) the fixed part.
- **Weight sync**: the loop's `weight_sync` spans (the servers are paused: nothing overlaps).
- **Loop**: `time/step` less waiting, training and syncing, per step.
- **The rollout client** (`client_per_sample_s`): its host time per generated sample outside the engine
  (sending requests, reward scoring, grouping). Per calibrated step, the loop's `wait_rollout` span less the
  time inside it that something the simulation models was busy (any engine's decode or prefill span, a trainer
  rank's span such as the behaviour log-prob pass, a colocated swap phase, which `loop_fixed_s` holds), over
  the samples the step generated (the metric `samples/generated`, cumulative, differenced; else
  `batch/sequences`); the median over the steps. `fit["client"]` also gives the engine's prefill spans per
  step, how spread out over the wait the requests reached it (a diagnostic; not modelled).
- **Lengths**: response lengths' mean and coefficient of variation and the mean prompt length, from metrics.
- **Colocation** (a run with cluster.colocate): the per-step seconds of the memory swap's phases, the metrics
  `time/colocate/{release,reload,offload,resume_weights,resume_kv}` (`fit["colocate"]`, with their sum
  `swap_s`). Where a phase's trace span (category "colocate") lies decides where the model holds it: inside
  a `train_step` the trainer's fixed part, inside a `weight_sync` the sync, outside every loop span the loop's
  residual, each already; inside a `wait_rollout` the simulation would miss it (its wait is generation), so
  those seconds join `loop_fixed_s`. Without spans a phase counts as outside them.

The first `skip` steps (start-up, compilation) are left out of every figure.
"""
from __future__ import annotations

import bisect
import math
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from m2po_megatron.plan.costs import Costs
from m2po_megatron.plan.sim import LengthDist

__all__ = ["COLOCATE_PHASES", "Calibration", "calibrate", "client_fit", "colocate_fit", "measured", "run_spans"]

DEFAULT_SKIP = 3
CPU_MAX_RUNNING = 256  # the CPU server's --max-running-requests default (rollout/local_server.py)
# a colocated step's swap, in its order (docs/colocate.md); metrics time/colocate/<phase>, trace category colocate
COLOCATE_PHASES = ("release", "reload", "offload", "resume_weights", "resume_kv")


@dataclass
class Calibration:
    costs: Costs
    response: LengthDist
    prompt_len: float
    accuracy: float
    fit: dict = field(default_factory=dict)  # diagnostics: spans used, residuals, contention grid
    run_dir: str = ""

    def to_dict(self) -> dict:
        return {"run_dir": self.run_dir, "costs": asdict(self.costs), "response": asdict(self.response),
                "prompt_len": self.prompt_len, "accuracy": self.accuracy, "fit": self.fit}

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        try:
            return cls(costs=Costs(**d["costs"]), response=LengthDist(**d["response"]),
                       prompt_len=float(d["prompt_len"]), accuracy=float(d["accuracy"]), fit=d.get("fit", {}),
                       run_dir=d.get("run_dir", ""))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a calibration file written by `m2po plan --calibrate` ({e!r}); write one "
                             "with `m2po plan --calibrate RUN_DIR --out FILE`") from None


# ---------------------------------------------------------------------------------------------- the timeline

class _Intervals:
    """The union of one component's busy intervals (seconds), for overlap queries."""

    def __init__(self, intervals: list[tuple[float, float]]):
        merged: list[list[float]] = []
        for a, b in sorted(intervals):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.starts = [m[0] for m in merged]
        self.iv = merged

    def clip(self, a: float, b: float) -> list[tuple[float, float]]:
        i = max(bisect.bisect_right(self.starts, a) - 1, 0)
        out = []
        while i < len(self.iv) and self.iv[i][0] < b:
            lo, hi = max(self.iv[i][0], a), min(self.iv[i][1], b)
            if hi > lo:
                out.append((lo, hi))
            i += 1
        return out


def run_spans(run_dir: str | Path) -> dict:
    """The run's spans in seconds, by kind: {"decode": [(t0, t1, b, kv, server)], "prefill": [(t0, t1, tokens,
    server)], "phases": [(t0, t1, name, rank)], "rank_busy": {rank: [(t0, t1)]}, "loop": {name: [(t0, t1,
    args)]}, "colocate": [(t0, t1, phase)]}."""
    from m2po_megatron.infra.trace import read_trace

    doc = read_trace(run_dir)
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    out: dict = {"decode": [], "prefill": [], "phases": [], "rank_busy": {}, "loop": {}, "colocate": []}
    for e in doc["traceEvents"]:
        if e.get("ph") != "X":
            continue
        t0 = e["ts"] / 1e6
        t1, proc, args = t0 + e["dur"] / 1e6, names.get(e["pid"], ""), e.get("args") or {}
        if e.get("cat") == "colocate":  # the swap's phases, wherever the loop traced them
            out["colocate"].append((t0, t1, e["name"].rsplit("/", 1)[-1]))
        elif e.get("cat") == "engine" and e["name"] == "decode":
            out["decode"].append((t0, t1, args["b"], args["kv"], proc))
        elif e.get("cat") == "engine" and e["name"] == "prefill":
            out["prefill"].append((t0, t1, args["tokens"], proc))
        elif proc.startswith("trainer") and e.get("tid") == "phases":
            out["phases"].append((t0, t1, e["name"], proc))
        elif proc.startswith("trainer") and e.get("tid") == "main":
            out["rank_busy"].setdefault(proc, []).append((t0, t1))
        elif proc == "loop" and e.get("tid") == "loop":
            out["loop"].setdefault(e["name"], []).append((t0, t1, args))
    return out


def _work(a: float, b: float, others: list[_Intervals], costs_speed) -> float:
    """Seconds of solo work in [a, b] for a component that was busy all along while `others` were busy as
    recorded: the integral of speed(1 + number of others busy)."""
    edges = [(a, 0)]
    for o in others:
        for lo, hi in o.clip(a, b):
            edges += [(lo, 1), (hi, -1)]
    edges.sort()
    work, n, t = 0.0, 0, a
    for x, d in edges:
        work += (x - t) * costs_speed(1 + n)
        n, t = n + d, x
    return work + (b - t) * costs_speed(1 + n)


# ---------------------------------------------------------------------------------------------- fits

def _lsq(rows: list[list[float]], y: list[float]) -> tuple[list[float], float]:
    """Non-negative least squares on relative residuals (each row divided by its y), by dropping negative
    terms and refitting; returns (coefficients, RMS relative residual)."""
    import numpy as np

    A = np.array(rows, dtype=float) / np.array(y)[:, None]
    ones = np.ones(len(y))
    active = list(range(A.shape[1]))
    coef = np.zeros(A.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(A[:, active], ones, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active = [c for c, v in zip(active, sol) if v > 0]
    resid = A @ coef - ones
    return coef.tolist(), float(np.sqrt(np.mean(resid ** 2)))


def _window(spans: dict, skip: int) -> tuple[float, float]:
    """From the start of step `skip`'s train_step (steps counted from 0) to the end of the last one."""
    steps = sorted(spans["loop"].get("train_step", []))
    if len(steps) <= skip:
        raise ValueError(f"the run's timeline has {len(steps)} train steps; calibration leaves out the first "
                         f"{skip} and needs at least one more (a longer run, or a smaller skip)")
    waits = sorted(spans["loop"].get("wait_rollout", []))
    start = waits[skip][0] if len(waits) > skip else steps[skip][0]
    return start, steps[-1][1]


@dataclass
class _Timeline:
    """What calibration reads off a run, inside its window: the engine's decode and prefill spans, rank 0's
    train steps and per-update phases (each forward_backward / logprob_pass with the tokens it covered: the
    step's, split evenly over its updates), and every component's busy intervals."""

    decode: list
    prefill: list
    steps: list
    phases: list
    tokens_of: dict
    tokens: int
    updates: int
    syncs: list
    rank: Optional[str]
    busy: dict  # component (server or rank) -> _Intervals
    _others: dict = field(init=False, repr=False)

    def __post_init__(self):  # the contention grid asks for them once per span per grid point
        self._others = {c: [b for k, b in self.busy.items() if k != c] for c in self.busy}

    def others(self, component: str) -> list[_Intervals]:
        return self._others.get(component, list(self.busy.values()))


def _timeline(rdir: Path, spans: dict, window: tuple[float, float], rows: list[dict], skip: int) -> _Timeline:
    lo, hi = window
    inside = lambda s: s[0] >= lo and s[1] <= hi  # noqa: E731
    busy = {s: _Intervals([(d[0], d[1]) for d in spans["decode"] + spans["prefill"] if d[-1] == s])
            for s in sorted({d[4] for d in spans["decode"]})}
    busy.update({r: _Intervals(v) for r, v in spans["rank_busy"].items()})
    rank = min(spans["rank_busy"], default=None)
    tokens_at = {r["step"]: r.get("batch/tokens", 0) for r in rows}  # the span's step counts from 0, metrics from 1
    step_tokens = lambda s: tokens_at.get(int(s[2].get("step", -2)) + 1, 0)  # noqa: E731
    steps = [s for s in spans["loop"].get("train_step", []) if inside(s)]
    phases = [p for p in spans["phases"] if p[3] == rank and inside(p)]
    tokens_of = {}
    for s in steps:
        inner = [p for p in phases if s[0] <= p[0] and p[1] <= s[1]]
        for name in ("forward_backward", "logprob_pass"):
            mine = [p for p in inner if p[2] == name]
            tokens_of.update({p: step_tokens(s) / len(mine) for p in mine})
    tl = _Timeline(decode=[d for d in spans["decode"] if inside(d)], prefill=[p for p in spans["prefill"] if inside(p)],
                   steps=steps, phases=phases, tokens_of=tokens_of, tokens=sum(step_tokens(s) for s in steps),
                   updates=sum(1 for p in phases if p[2] == "optimizer"),
                   syncs=[s for s in spans["loop"].get("weight_sync", []) if inside(s)], rank=rank, busy=busy)
    if not tl.steps or not tl.tokens or not tl.updates:
        raise ValueError(f"{rdir}: the timeline has no complete train steps with trainer phases after step {skip}")
    return tl


def _fit_contention(tl: _Timeline, base: Costs) -> tuple[float, list[float], Optional[float]]:
    """The contention under which the decode steps and the trainer's per-token phases fit their linear costs
    best: both slow down while the other computes (a grid over [0, 2]; each kind's relative error weighs the
    same). Returns (contention, the decode fit's [fixed, per sequence, per KV token], RMS relative error)."""
    import dataclasses

    grid = [i / 50 for i in range(101)] if base.shared_cores else [0.0]
    best = (math.inf, 0.0, [0.0, 0.0, 0.0])
    errs: list[float] = []
    for alpha in grid:
        speed = dataclasses.replace(base, contention=alpha).speed
        errs, coef = [], [0.0, 0.0, 0.0]
        if tl.decode:
            y = [_work(t0, t1, tl.others(s), speed) for t0, t1, _, _, s in tl.decode]
            coef, err = _lsq([[1.0, b, kv] for _, _, b, kv, _ in tl.decode], y)
            errs.append(err)
        for name in ("forward_backward", "logprob_pass"):
            mine = [p for p in tl.tokens_of if p[2] == name and tl.tokens_of[p] > 0]
            if mine:
                errs.append(_lsq([[tl.tokens_of[p]] for p in mine],
                                 [_work(p[0], p[1], tl.others(tl.rank), speed) for p in mine])[1])
        err = statistics.fmean(e * e for e in errs) if errs else 0.0
        if err < best[0]:
            best = (err, alpha, coef)
    return best[1], best[2], (round(math.sqrt(best[0]), 4) if errs else None)


def calibrate(run_dir: str | Path, skip: int = DEFAULT_SKIP, cores: Optional[int] = None) -> Calibration:
    """Fit a Costs on RUN_DIR (see the module's docstring). `cores`: the host's cores when the trainer and the
    servers shared them (default: this machine's, for a run of the CPU server; 0 for a GPU run)."""
    import dataclasses

    from m2po_megatron.config import load_config
    from m2po_megatron.run.metrics import read_metrics

    rdir = Path(run_dir)
    cfg = load_config(rdir / "config.yaml", check_files=False)
    spans = run_spans(rdir)
    window = _window(spans, skip)
    every = [r for r in read_metrics(rdir / "metrics.jsonl") if "time/step" in r]
    rows = [r for r in every if r["step"] > skip]
    if not rows:
        raise ValueError(f"{rdir / 'metrics.jsonl'} has no training step after the first {skip}")
    tl = _timeline(rdir, spans, window, rows, skip)
    if cores is None:
        cores = (os.cpu_count() or 1) if tl.decode else 0
    base = Costs(train_fixed_s=0.0, train_per_update_s=0.0, train_per_token_s=0.0, logprob_per_token_s=0.0,
                 decode_fixed_s=0.0, decode_per_seq_s=0.0, decode_per_kv_s=0.0, prefill_per_token_s=0.0,
                 max_running=CPU_MAX_RUNNING, sync_fixed_s=0.0, sync_per_byte_s=0.0, weight_bytes=0.0,
                 shared_cores=cores)
    alpha, decode_coef, rms = _fit_contention(tl, base)
    costs = dataclasses.replace(base, contention=alpha)
    # every other figure is work, not wall time: a span's time less the slowdown from what overlapped it
    work = lambda t0, t1, comp: _work(t0, t1, tl.others(comp), costs.speed)  # noqa: E731
    pre_tokens = sum(p[2] for p in tl.prefill)
    per = {name: sum(work(p[0], p[1], tl.rank) for p in tl.phases if p[2] == name)
           for name in ("forward_backward", "logprob_pass", "optimizer")}
    fixed = (sum(work(s[0], s[1], tl.rank) for s in tl.steps) - sum(per.values())) / len(tl.steps)
    mean = lambda k: statistics.fmean(r.get(k, 0.0) for r in rows)  # noqa: E731
    loop_s = max(0.0, mean("time/step") - mean("time/wait_rollout") - mean("time/train") - mean("time/weight_sync"))
    colocate = colocate_fit(rows, spans, window)
    if colocate:
        loop_s += colocate["in_wait_s"]
    client = client_fit(every, spans, skip)
    costs = dataclasses.replace(
        costs, train_fixed_s=max(fixed, 0.0), train_per_update_s=per["optimizer"] / tl.updates,
        train_per_token_s=per["forward_backward"] / tl.tokens, logprob_per_token_s=per["logprob_pass"] / tl.tokens,
        decode_fixed_s=decode_coef[0], decode_per_seq_s=decode_coef[1], decode_per_kv_s=decode_coef[2],
        prefill_per_token_s=sum(work(p[0], p[1], p[3]) for p in tl.prefill) / pre_tokens if pre_tokens else 0.0,
        sync_fixed_s=statistics.fmean(s[1] - s[0] for s in tl.syncs) if tl.syncs else 0.0, loop_fixed_s=loop_s,
        client_per_sample_s=client["per_sample_s"] if client else 0.0,
        source=f"calibrated on {rdir} (steps after {skip})")
    fit = {"skip": skip, "steps": len(rows), "decode_spans": len(tl.decode), "cores": cores, "rms_rel_error": rms,
           "contention": alpha, "train_steps": len(tl.steps), "updates": tl.updates, "syncs": len(tl.syncs),
           "prefill_spans": len(tl.prefill), **({"colocate": colocate} if colocate else {}),
           **({"client": client} if client else {})}
    lens = [(r["response_length/mean"], r.get("response_length/std", 0.0)) for r in rows
            if "response_length/mean" in r]
    m = statistics.fmean(x for x, _ in lens)
    sd = math.sqrt(statistics.fmean(s * s for _, s in lens))
    samples = statistics.fmean(r.get("batch/sequences", 0) or 1 for r in rows)
    prompt_len = max(1.0, mean("batch/tokens") / samples - m)
    return Calibration(costs=costs, response=LengthDist(m, sd / m if m else 0.0, int(cfg.rollout.max_new_tokens)),
                       prompt_len=prompt_len, accuracy=min(max(mean("reward/mean"), 0.0), 1.0), fit=fit,
                       run_dir=str(rdir))


def colocate_fit(rows: list[dict], spans: dict, window: tuple[float, float]) -> Optional[dict]:
    """A colocated run's swap per step: {phase: mean seconds, "swap_s": their sum, "in_wait_s": the seconds of
    the phases' spans inside wait_rollout spans per step, "spans": how many}; None when the rows have none of
    the phases' metrics (a disaggregated run)."""
    keys = [f"time/colocate/{p}" for p in COLOCATE_PHASES]
    if not any(k in r for r in rows for k in keys):
        return None
    out = {p: statistics.fmean(r.get(k, 0.0) for r in rows) for p, k in zip(COLOCATE_PHASES, keys)}
    out["swap_s"] = sum(out[p] for p in COLOCATE_PHASES)
    lo, hi = window
    mine = [s for s in spans.get("colocate", []) if s[0] >= lo and s[1] <= hi and s[2] in COLOCATE_PHASES]
    waits = _Intervals([(a, b) for a, b, _ in spans["loop"].get("wait_rollout", [])])
    in_wait = sum(b - a for s in mine for a, b in waits.clip(s[0], s[1]))
    out["in_wait_s"] = in_wait / len(rows)
    out["spans"] = len(mine)
    return out


def client_fit(rows: list[dict], spans: dict, skip: int) -> Optional[dict]:
    """The rollout client's host time per generated sample (the module's docstring): {"per_sample_s": the
    median over the steps after `skip`, "steps", "gap_s": the mean seconds per step of the wait outside every
    modelled span, "samples": the mean samples generated per step, "prefills_per_step": the engine's prefill
    spans inside the wait, mean}; None when no step has a wait span and samples. `rows`: every metrics row
    with time/step (the earlier ones difference samples/generated). The k-th wait_rollout span (from 0) is
    step k + 1's, as the loop traces them."""
    waits = sorted(spans["loop"].get("wait_rollout", []))
    engine = [(d[0], d[1]) for d in spans["decode"] + spans["prefill"]]
    modelled = _Intervals(engine + [iv for r in spans["rank_busy"].values() for iv in r]
                          + [(a, b) for a, b, _ in spans.get("colocate", [])])
    prefill_starts = sorted(p[0] for p in spans["prefill"])
    by_step = {r["step"]: r for r in rows}
    per, gaps, counts, spread = [], [], [], []
    for r in sorted(rows, key=lambda r: r["step"]):
        k = r["step"]
        if k <= skip or k > len(waits):
            continue
        prev = by_step.get(k - 1, {"samples/generated": 0} if k == 1 else {})
        if "samples/generated" in r and "samples/generated" in prev:
            n = r["samples/generated"] - prev["samples/generated"]
        else:
            n = r.get("batch/sequences", 0)
        a, b = waits[k - 1][0], waits[k - 1][1]
        gap = (b - a) - sum(hi - lo for lo, hi in modelled.clip(a, b))
        if n <= 0:
            continue
        per.append(max(gap, 0.0) / n)
        gaps.append(gap)
        counts.append(n)
        spread.append(bisect.bisect_left(prefill_starts, b) - bisect.bisect_left(prefill_starts, a))
    if not per:
        return None
    return {"per_sample_s": statistics.median(per), "steps": len(per), "gap_s": statistics.fmean(gaps),
            "samples": statistics.fmean(counts), "prefills_per_step": statistics.fmean(spread)}


def measured(run_dir: str | Path, skip: int = DEFAULT_SKIP) -> dict:
    """What the run measured after its first `skip` steps, in SimResult.summary()'s terms."""
    from m2po_megatron.run.metrics import read_metrics

    rows = [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if r["step"] > skip and "time/step" in r]
    if not rows:
        raise ValueError(f"{run_dir}: no training step after the first {skip} in metrics.jsonl")
    mean = lambda k: statistics.fmean(r.get(k, 0.0) for r in rows)  # noqa: E731
    span = sum(r["time/step"] for r in rows)
    n = [r.get("batch/sequences", 0) for r in rows]
    return {"step_s": mean("time/step"), "wait_s": mean("time/wait_rollout"), "train_s": mean("time/train"),
            "sync_s": mean("time/weight_sync"), "tokens_per_s": sum(r.get("batch/tokens", 0) for r in rows) / span,
            "steps_per_hour": 3600 * len(rows) / span,
            "staleness_mean": sum(r.get("staleness/mean", 0.0) * k for r, k in zip(rows, n)) / max(sum(n), 1),
            "staleness_max": max(r.get("staleness/max", 0) for r in rows)}


def predict(cfg, cal: Calibration, steps: Optional[int] = None, skip: int = DEFAULT_SKIP, seed: int = 0) -> dict:
    """What the simulation predicts for a run of `cfg` on the calibrated host: its steps (default
    train.steps) simulated, the first `skip` left out as `measured` does. Response lengths are the
    calibration run's, cut at this recipe's max_new_tokens."""
    import dataclasses

    from m2po_megatron.plan.search import spec_from_config
    from m2po_megatron.plan.sim import simulate

    resp = dataclasses.replace(cal.response, max=int(cfg.rollout.max_new_tokens))
    spec = spec_from_config(cfg, num_servers=cfg.rollout.num_servers, response=resp,
                            prompt_len=max(1, round(cal.prompt_len)), accuracy=cal.accuracy)
    n = steps or int(cfg.train.steps)
    return simulate(spec, cal.costs, steps=n, seed=seed, skip=min(skip, n - 1)).summary()
