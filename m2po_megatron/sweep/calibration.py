"""The pre-registered drift calibration of issue 34 (docs/results/toy-table1.md, "The paper's drift"): for each cell of
the grid (learning rate x optimizer mini-batch) the four criteria that say whether the toy moves its policy
per update as little as the paper's runs do, the cell's horizon from its on-policy curve, and its cost. The
numbers and rules here are the pre-registration's; no accuracy of a stale arm enters the choice.

`m2po report DIR --calibration` prints the table (Markdown) and writes calibration.md and calibration.json."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Optional

from m2po_megatron.sweep.report import ReportError, RunRecord

ONPOLICY_CLIP_MAX = 0.001  # 1. on-policy GRPO's mean clip fraction
STALE_CLIP = (0.005, 0.015)  # 2. stale GRPO's mean clip fraction
MASK_MAX = 0.001  # 3. M2PO (remove)'s mean masked fraction
NOTR_STEPS = (4, 8, 12, 16)  # 4. GRPO without trust region: these evaluations (updates 16-64) ...
NOTR_TOLERANCE = 1.5  # ... at least its step-0 evaluation minus this many points
HORIZON_QUANTUM, HORIZON_MIN = 25, 100  # H: c ln 10 rounded up to a multiple of 25 steps, at least 100
FALLBACK_LRS = (2.5e-5, 1.25e-5)  # the axis written down with the protocol, run when no grid cell matches
ARMS = ("grpo-s0", "grpo-stale", "grpo_notr-stale", "m2po-remove", "m2po-cap")


class CalibrationError(ReportError):
    """The runs do not form the calibration grid; the message names the run and what is missing."""


@dataclass
class Cell:
    lr: float
    batch: int  # sequences per optimizer update
    arms: dict[str, RunRecord] = field(default_factory=dict)
    values: dict[str, Optional[float]] = field(default_factory=dict)
    passed: dict[str, Optional[bool]] = field(default_factory=dict)
    horizon: Optional[int] = None
    fit: Optional[tuple[float, float, float]] = None  # (a, b, c) of acc(t) = a - b exp(-t / c)
    cost: Optional[float] = None  # generated tokens to the end of the horizon

    @property
    def matches(self) -> Optional[bool]:
        """True or False when every criterion could be decided, else None."""
        if any(v is None for v in self.passed.values()) or len(self.passed) < 4:
            return None
        return all(self.passed.values())


def arm(r: RunRecord) -> str:
    """The run's arm: on-policy GRPO, or a stale GRPO, GRPO without trust region, M2PO remove or cap."""
    name, stale = r.method, r.staleness not in ("0", "0.0")
    if name == "grpo":
        return "grpo-stale" if stale else "grpo-s0"
    if name == "grpo_notr":
        return "grpo_notr-stale"
    if name == "m2po":
        return f"m2po-{r.flat.get('algo.m2po.rule', 'remove')}"
    return name


def cell_key(r: RunRecord) -> tuple[float, int]:
    f = r.flat
    try:
        seqs = int(f["train.prompts_per_step"]) * int(f["rollout.n_samples_per_prompt"]) // int(f["train.updates_per_step"])
        return float(f["optim.lr"]), seqs
    except (KeyError, TypeError, ValueError) as e:
        raise CalibrationError(f"{r.path}/config.yaml lacks {e}; give runs of m2po train") from None


def mean_over_updates(r: RunRecord, key: str) -> Optional[float]:
    """The mean of `key` over all updates of steps >= 1: the mean of the step means, as every step of the
    grid has the same number of updates (each step's value is the mean over its updates)."""
    pts = [v for s, v in r.series.get(key, {}).items() if s >= 1 and math.isfinite(v)]
    return statistics.fmean(pts) if pts else None


def notr_holds(r: RunRecord) -> tuple[Optional[float], Optional[bool]]:
    """(the lowest of its evaluations at NOTR_STEPS minus its step-0 evaluation, criterion 4); None when an
    evaluation is missing."""
    ev = {s: row.get("avg") for s, row in r.evals.items()}
    if ev.get(0) is None or any(ev.get(s) is None for s in NOTR_STEPS):
        return None, None
    drop = min(ev[s] for s in NOTR_STEPS) - ev[0]
    return drop, drop >= -NOTR_TOLERANCE


def fit_saturation(points: dict[int, float]) -> Optional[tuple[float, float, float]]:
    """Least squares of acc(t) = a - b exp(-t / c) over c on a log grid of 5..5,000 steps (a and b solved in
    closed form for each c); None with fewer than 3 points."""
    if len(points) < 3:
        return None
    ts, ys = zip(*sorted(points.items()))
    best = None
    for i in range(400):
        c = 5.0 * (1000.0 ** (i / 399))
        xs = [-math.exp(-t / c) for t in ts]  # acc = a + b * x
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx <= 0:
            continue
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        a = my - b * mx
        sse = sum((a + b * x - y) ** 2 for x, y in zip(xs, ys))
        if best is None or sse < best[0]:
            best = (sse, a, b, c)
    return None if best is None else best[1:]


def horizon(fit: Optional[tuple[float, float, float]]) -> Optional[int]:
    """The step where the fit reaches 90 % of its gain (c ln 10), rounded up to 25 steps, at least 100; None
    when the fit gains nothing."""
    if fit is None or fit[1] <= 0:
        return None
    t90 = fit[2] * math.log(10)
    return max(HORIZON_MIN, HORIZON_QUANTUM * math.ceil(t90 / HORIZON_QUANTUM))


def evaluate(cell: Cell) -> Cell:
    """Fill the cell's criteria, horizon and cost from its runs (missing arms leave their criterion None)."""
    a = cell.arms
    v, p = cell.values, cell.passed
    v["onpolicy_clip"] = mean_over_updates(a["grpo-s0"], "clip_frac") if "grpo-s0" in a else None
    v["stale_clip"] = mean_over_updates(a["grpo-stale"], "clip_frac") if "grpo-stale" in a else None
    v["m2po_masked"] = mean_over_updates(a["m2po-remove"], "m2po/masked_frac") if "m2po-remove" in a else None
    v["notr_drop"], p["notr"] = notr_holds(a["grpo_notr-stale"]) if "grpo_notr-stale" in a else (None, None)
    p["onpolicy_clip"] = None if v["onpolicy_clip"] is None else v["onpolicy_clip"] <= ONPOLICY_CLIP_MAX
    p["stale_clip"] = None if v["stale_clip"] is None else STALE_CLIP[0] <= v["stale_clip"] <= STALE_CLIP[1]
    p["m2po_masked"] = None if v["m2po_masked"] is None else v["m2po_masked"] <= MASK_MAX
    for name, key in (("m2po_m2_before", "m2po/m2_before"), ("m2po_cap_masked", "m2po/masked_frac"),
                      ("stale_kl_k3", "kl/k3"), ("m2po_kept_ratio_max", "ratio/kept_max")):
        src = {"m2po_cap_masked": "m2po-cap", "stale_kl_k3": "grpo-stale"}.get(name, "m2po-remove")
        v[name] = mean_over_updates(a[src], key) if src in a else None
    if "grpo-s0" in a:
        on = a["grpo-s0"]
        cell.fit = fit_saturation({s: row["avg"] for s, row in on.evals.items() if "avg" in row})
        cell.horizon = horizon(cell.fit)
        tokens = mean_over_updates(on, "batch/tokens")
        cell.cost = tokens * cell.horizon if tokens is not None and cell.horizon is not None else None
    return cell


def finished(r: RunRecord) -> bool:
    """The run trained to its train.steps (its last logged training step)."""
    last = max(r.series.get("version", {}), default=0)
    return last >= int(r.flat.get("train.steps", 0) or 0) > 0


def cells(records: list[RunRecord]) -> list[Cell]:
    """The grid's cells in (mini-batch, lr descending) order, each with its arms; two runs of one arm in one
    cell are an error (the calibration has one seed)."""
    out: dict[tuple[float, int], Cell] = {}
    for r in records:
        lr, batch = cell_key(r)
        c = out.setdefault((lr, batch), Cell(lr=lr, batch=batch))
        if not finished(r):  # a running or stopped run's means would be a partial horizon's
            continue
        name = arm(r)
        if name in c.arms:
            raise CalibrationError(f"two runs of arm {name} in the cell lr={lr:g}, batch={batch}: "
                                   f"{c.arms[name].path} and {r.path}")
        c.arms[name] = r
    return [evaluate(out[k]) for k in sorted(out, key=lambda k: (k[1], -k[0]))]


def choose(cs: list[Cell]) -> Optional[Cell]:
    """The cheapest matching cell (ties: the first in grid order); None when no cell matches."""
    ok = [c for c in cs if c.matches and c.cost is not None]
    return min(ok, key=lambda c: c.cost) if ok else None


def _pct(x: Optional[float], digits: int = 2) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f} %"


def _mark(ok: Optional[bool]) -> str:
    return "?" if ok is None else ("yes" if ok else "no")


def markdown(cs: list[Cell]) -> str:
    head = ("| lr | mini-batch | 1. on-policy clip <= 0.1 % | 2. stale GRPO clip 0.5-1.5 % | 3. M2PO masked <= 0.1 % "
            "| 4. no-TR drop by step 16 >= -1.5 | match | M2 before (M2PO) | M2PO cap masked | k3 KL (stale GRPO) "
            "| kept ratio max (M2PO) | horizon H | tokens to H |")
    lines = [head, "|" + "---|" * 13]
    for c in cs:
        v, p = c.values, c.passed
        drop = "-" if v["notr_drop"] is None else f"{v['notr_drop']:+.1f}"
        lines.append(
            f"| {c.lr:g} | {c.batch} | {_pct(v['onpolicy_clip'])} {_mark(p['onpolicy_clip'])} "
            f"| {_pct(v['stale_clip'])} {_mark(p['stale_clip'])} | {_pct(v['m2po_masked'])} {_mark(p['m2po_masked'])} "
            f"| {drop} {_mark(p['notr'])} | **{_mark(c.matches)}** "
            f"| {'-' if v['m2po_m2_before'] is None else format(v['m2po_m2_before'], '.3g')} "
            f"| {_pct(v['m2po_cap_masked'])} | {'-' if v['stale_kl_k3'] is None else format(v['stale_kl_k3'], '.3g')} "
            f"| {'-' if v['m2po_kept_ratio_max'] is None else format(v['m2po_kept_ratio_max'], '.3g')} "
            f"| {c.horizon or '-'} | {'-' if c.cost is None else f'{c.cost:,.0f}'} |")
    chosen = choose(cs)
    missing = [f"lr={c.lr:g}/batch={c.batch}: {', '.join(sorted(set(ARMS) - set(c.arms)))}" for c in cs
               if set(ARMS) - set(c.arms)]
    lines.append("")
    if missing:
        lines.append("Arms without a run yet: " + "; ".join(missing) + ".")
    if chosen is not None:
        a, b, cc = chosen.fit
        lines.append(f"Chosen (the cheapest matching cell): lr {chosen.lr:g}, mini-batch {chosen.batch}; on-policy fit "
                     f"acc(t) = {a:.1f} - {b:.1f} exp(-t / {cc:.0f}), horizon {chosen.horizon} steps.")
    elif missing or any(c.matches is None for c in cs):
        lines.append("No cell chosen yet: the cells so far do not match, and the grid is not complete.")
    elif fallback_done(cs):
        lines.append("No cell matches the paper's drift, the pre-registered fallback axis included (lr 2.5e-5 and "
                     "1.25e-5 at both mini-batch sizes): as the protocol fixed, the calibration stops here.")
    else:
        lines.append("No cell matches the paper's drift: the pre-registered fallback axis comes next "
                     "(lr 2.5e-5 and 1.25e-5 at both mini-batch sizes).")
    return "\n".join(lines) + "\n"


def fallback_done(cs: list[Cell]) -> bool:
    """Whether every fallback lr has a decided cell at every mini-batch size of the grid."""
    batches = {c.batch for c in cs}
    done = {(c.lr, c.batch) for c in cs if c.matches is not None}
    return bool(batches) and all((lr, b) in done for lr in FALLBACK_LRS for b in batches)


# the four criteria as plotted: (value key, title, accepted band (low, high), scale to percent or points)
_PANELS = (("onpolicy_clip", "1. on-policy GRPO: tokens clipped (%)", (0.0, ONPOLICY_CLIP_MAX), 100),
           ("stale_clip", "2. stale GRPO: tokens clipped (%)", STALE_CLIP, 100),
           ("m2po_masked", "3. M2PO (remove): tokens masked (%)", (0.0, MASK_MAX), 100),
           ("notr_drop", "4. GRPO without TR: lowest eval at steps 4-16 minus step 0 (points)",
            (-NOTR_TOLERANCE, None), 1))


def figure(cs: list[Cell], path) -> None:
    """One panel per criterion: its value against the learning rate (log scale), a line per mini-batch size, the
    pre-registered band shaded; a cell matches where all four of its points lie in their bands."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (key, title, (lo, hi), scale) in zip(axes.flat, _PANELS):
        for batch in sorted({c.batch for c in cs}):
            pts = sorted((c.lr, c.values[key] * scale) for c in cs if c.batch == batch and c.values.get(key) is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"mini-batch {batch}")
        ax.set_xscale("log")
        lrs = sorted({c.lr for c in cs})
        ax.set_xticks(lrs, [f"{lr:g}" for lr in lrs], fontsize=7)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_yscale("symlog", linthresh=0.1) if scale == 100 else None
        top = ax.get_ylim()[1]
        ax.axhspan(lo * scale, hi * scale if hi is not None else top, color="tab:green", alpha=0.15,
                   label="accepted")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("learning rate")
        ax.legend(fontsize=8)
    matched = [f"lr {c.lr:g} x {c.batch}" for c in cs if c.matches]
    fig.suptitle("Drift calibration: each criterion per cell (docs/reproduce.md); matching cells: "
                 + (", ".join(matched) or "none"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def as_json(cs: list[Cell]) -> list[dict]:
    return [{"lr": c.lr, "batch": c.batch, "arms": {k: str(r.path) for k, r in c.arms.items()}, "values": c.values,
             "passed": c.passed, "matches": c.matches, "fit": c.fit, "horizon": c.horizon, "cost": c.cost}
            for c in cs]
