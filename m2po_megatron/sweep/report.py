"""A Table-1 style report of finished runs: held-out accuracy per method and staleness, over seeds.

Each run directory holds the resolved `config.yaml` and `metrics.jsonl` that `m2po train` writes (eval rows
carry `eval/<benchmark>/pass@1` and `eval/avg/pass@1`, in percent; a run evaluated afterwards by `m2po eval`
may instead have `eval/summary.csv`). Runs are grouped by model, method (algo.name) and staleness (in
optimizer updates: lag_steps x updates_per_step for fixed_lag, 0 on-policy, `<=max_staleness` for bounded);
runs of one group that differ in anything but seeds, names and paths are split into variants, labelled by
what differs. Per run, the **last** evaluation is the last eval row and the **best** is the eval row with the
highest benchmark average after step 0 (the paper picks its best checkpoint by that average); per group,
each cell is the mean and the sample standard deviation (n - 1) over its runs, and n, the number of runs
behind the cell.
"""
from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import yaml

from m2po_megatron.sweep.plot import read_metrics_file

METHOD_NAMES = {"grpo": "GRPO", "grpo_notr": "GRPO (no TR)", "gspo": "GSPO", "m2po": "M2PO"}
METHOD_ORDER = ["grpo", "grpo_notr", "gspo", "m2po"]
BENCH_ORDER = ["aime24", "aime25", "amc23", "amc24", "math500", "gaokao2023en", "minerva_math", "olympiadbench"]
# Config keys that do not make runs different experiments (seeds, names, paths, ports, logging).
IGNORED = ("run.", "logging.", "checkpoint.", "cluster.ray_", "rollout.host", "rollout.port", "rollout.urls",
           "rollout.api_key", "data.shuffle_seed", "model.hf_path", "model.tokenizer", "model.megatron_ckpt",
           "data.train_path", "data.eval_paths")
DIAGNOSTICS = [("M2 before masking", "m2po/m2_before", False), ("M2 after masking", "m2po/m2_after", False),
               ("masked fraction", "m2po/masked_frac", False), ("clip fraction", "clip_frac", False),
               ("ratio max", "ratio/max", True), ("ratio min", "ratio/min", True)]


class ReportError(ValueError):
    """The report's input is wrong; the message names the file and the fix."""


@dataclass
class RunRecord:
    path: Path
    model: str
    method: str
    staleness: str
    seed: Optional[int]
    flat: dict  # flattened config, for variant detection
    evals: dict[int, dict[str, float]]  # step -> benchmark -> pass@1 % ("avg" included)
    series: dict[str, dict[int, float]]  # metrics key -> step -> value
    variant: str = ""


@dataclass
class Cell:
    values: list[float] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values) if self.values else math.nan

    @property
    def std(self) -> float:
        return statistics.stdev(self.values) if len(self.values) > 1 else math.nan

    def text(self) -> str:
        if not self.values:
            return "-"
        return f"{self.mean:.1f}" + (f" ± {self.std:.1f}" if self.n > 1 else "") + f" ({self.n})"


@dataclass
class Group:
    model: str
    method: str
    staleness: str
    variant: str
    runs: list[RunRecord]
    last: dict[str, Cell]
    best: dict[str, Cell]
    best_step: Cell
    last_step: Cell

    @property
    def label(self) -> str:
        return " ".join(x for x in (METHOD_NAMES.get(self.method, self.method), f"s={self.staleness}",
                                    self.variant) if x)


# ----------------------------------------------------------------------------------------------------
# Reading runs
# ----------------------------------------------------------------------------------------------------
def find_runs(dirs: Sequence[str | Path]) -> list[Path]:
    """Run directories (holding metrics.jsonl) among `dirs` and their sub-directories (two levels)."""
    found: list[Path] = []
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            raise ReportError(f"{d}: not a directory; give run directories or a sweep's output directory")
        if (d / "metrics.jsonl").is_file():
            found.append(d)
            continue
        subs = sorted(p.parent for p in list(d.glob("*/metrics.jsonl")) + list(d.glob("*/*/metrics.jsonl")))
        if not subs:
            raise ReportError(f"{d}: no metrics.jsonl in it or below it; is it a run or sweep output directory?")
        found += subs
    return sorted(dict.fromkeys(p.resolve() for p in found))


def _flatten(d, prefix="") -> dict:
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


def _staleness(flat: dict) -> str:
    mode = flat.get("staleness.mode", "on_policy")
    if mode == "fixed_lag":
        return str(int(flat.get("staleness.lag_steps", 0)) * int(flat.get("train.updates_per_step", 1)))
    if mode == "bounded":
        return f"<={flat.get('staleness.max_staleness')}"
    return "0"


def _model(flat: dict) -> str:
    for key in ("model.hf_path", "model.hf_config"):
        if flat.get(key):
            p = Path(str(flat[key]))
            return (p.parent.name if p.name == "config.json" else p.name).split("__")[-1]
    return "model"


def _evals(run: Path, series: dict[str, dict[int, float]]) -> dict[int, dict[str, float]]:
    evals: dict[int, dict[str, float]] = {}
    for key, pts in series.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "eval" and parts[2] == "pass@1":
            for step, v in pts.items():
                evals.setdefault(step, {})[parts[1]] = v
    summary = run / "eval" / "summary.csv"
    if not evals and summary.is_file():  # evaluated afterwards (m2po eval): one row per call
        with open(summary) as f:
            for row in csv.DictReader(f):
                try:
                    step = int(row.pop("step"))
                    evals[step] = {k: float(v) for k, v in row.items() if v not in (None, "")}
                except (KeyError, ValueError) as e:
                    raise ReportError(f"{summary}: bad row {row} ({e}); expected step,<benchmark>...,avg") from None
    for row in evals.values():
        if "avg" not in row:
            benches = [v for k, v in row.items() if k != "avg"]
            if benches:
                row["avg"] = statistics.fmean(benches)
    return evals


def load_run(run: str | Path) -> RunRecord:
    run = Path(run)
    cfg_path = run / "config.yaml"
    if not cfg_path.is_file():
        raise ReportError(f"{cfg_path} is missing: the report reads each run's resolved config (m2po train "
                          f"writes it); give run directories of m2po train")
    try:
        flat = _flatten(yaml.safe_load(cfg_path.read_text()) or {})
    except yaml.YAMLError as e:
        raise ReportError(f"{cfg_path}: not valid YAML ({e})") from None
    try:
        series = read_metrics_file(run / "metrics.jsonl")
    except (OSError, ValueError) as e:
        raise ReportError(str(e)) from None
    seed = flat.get("run.seed")
    return RunRecord(path=run, model=_model(flat), method=str(flat.get("algo.name", "?")),
                     staleness=_staleness(flat), seed=int(seed) if seed is not None else None, flat=flat,
                     evals=_evals(run, series), series=series)


# ----------------------------------------------------------------------------------------------------
# Grouping and statistics
# ----------------------------------------------------------------------------------------------------
def _relevant(flat: dict) -> dict:
    return {k: v for k, v in flat.items() if not k.startswith(IGNORED)}


def _assign_variants(records: list[RunRecord]) -> None:
    by_key: dict[tuple, list[RunRecord]] = {}
    for r in records:
        by_key.setdefault((r.model, r.method, r.staleness), []).append(r)
    for rs in by_key.values():
        configs = [_relevant(r.flat) for r in rs]
        keys = sorted({k for c in configs for k in c})
        differing = [k for k in keys if len({repr(c.get(k)) for c in configs}) > 1]
        for r, c in zip(rs, configs):
            r.variant = ", ".join(f"{k}={c.get(k)}" for k in differing)


def last_and_best(evals: dict[int, dict[str, float]]) -> tuple[Optional[int], Optional[int]]:
    """(step of the last evaluation, step of the best one by the benchmark average, after step 0)."""
    if not evals:
        return None, None
    steps = sorted(evals)
    trained = [s for s in steps if s > 0 and "avg" in evals[s]] or [s for s in steps if "avg" in evals[s]]
    best = max(trained, key=lambda s: (evals[s]["avg"], -s)) if trained else None  # ties: the earlier step
    return steps[-1], best


def benchmarks(records: list[RunRecord]) -> list[str]:
    names = {b for r in records for row in r.evals.values() for b in row if b != "avg"}
    ordered = [b for b in BENCH_ORDER if b in names] + sorted(names - set(BENCH_ORDER))
    return ordered + ["avg"]


def summarize(records: list[RunRecord]) -> list[Group]:
    _assign_variants(records)
    benches = benchmarks(records)
    groups: dict[tuple, list[RunRecord]] = {}
    for r in records:
        groups.setdefault((r.model, r.method, r.staleness, r.variant), []).append(r)
    out = []
    for (model, method, s, variant), rs in groups.items():
        last = {b: Cell() for b in benches}
        best = {b: Cell() for b in benches}
        best_step, last_step = Cell(), Cell()
        for r in rs:
            ls, bs = last_and_best(r.evals)
            if ls is not None:
                last_step.values.append(float(ls))
                for b in benches:
                    if b in r.evals[ls]:
                        last[b].values.append(r.evals[ls][b])
            if bs is not None:
                best_step.values.append(float(bs))
                for b in benches:
                    if b in r.evals[bs]:
                        best[b].values.append(r.evals[bs][b])
        out.append(Group(model, method, s, variant, sorted(rs, key=lambda r: (r.seed or 0, str(r.path))), last,
                         best, best_step, last_step))

    def order(g: Group):
        s = g.staleness.lstrip("<=")
        m = METHOD_ORDER.index(g.method) if g.method in METHOD_ORDER else len(METHOD_ORDER)
        return g.model, float(s) if s.replace(".", "", 1).isdigit() else math.inf, m, g.method, g.variant

    return sorted(out, key=order)


# ----------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------
def markdown(groups: list[Group]) -> str:
    if not groups:
        return "(no runs)\n"
    benches = list(groups[0].last)
    multi_model = len({g.model for g in groups}) > 1
    head_cols = (["model"] if multi_model else []) + ["method", "s"]
    out = []
    for when, title in (("last", "at the last evaluation"),
                        ("best", "at the best evaluation (highest benchmark average after step 0)")):
        out.append(f"Held-out pass@1 (%) {title}: mean ± std over runs (n runs)\n")
        cols = head_cols + [("Avg" if b == "avg" else b) for b in benches] + ["step"]
        if when == "last":
            cols.append("Avg per run (last)")
        out.append("| " + " | ".join(cols) + " |")
        out.append("|" + "---|" * len(cols))
        for g in groups:
            cells = getattr(g, when)
            step = g.last_step if when == "last" else g.best_step
            row = ([g.model] if multi_model else []) + [
                METHOD_NAMES.get(g.method, g.method) + (f" ({g.variant})" if g.variant else ""), g.staleness]
            row += [cells[b].text() for b in benches]
            row.append(f"{step.mean:.0f}" if step.values else "-")
            if when == "last":
                per_run = []
                for r in g.runs:
                    ls, _ = last_and_best(r.evals)
                    per_run.append(f"{r.evals[ls]['avg']:.1f}" if ls is not None and "avg" in r.evals[ls] else "-")
                row.append(", ".join(per_run))
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out)


def write_csv(groups: list[Group], path: Path) -> Path:
    """Long format: one line per group x (last | best) x benchmark, with mean, std, n and the run values."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "method", "staleness", "variant", "eval", "benchmark", "mean", "std", "n",
                    "values", "runs"])
        for g in groups:
            runs = ";".join(str(r.path) for r in g.runs)
            for when in ("last", "best"):
                for b, c in getattr(g, when).items():
                    w.writerow([g.model, g.method, g.staleness, g.variant, when, b,
                                "" if not c.values else f"{c.mean:.6g}", "" if c.n < 2 else f"{c.std:.6g}", c.n,
                                ";".join(f"{v:.6g}" for v in c.values), runs])
    return path


def _mean_curve(series_list: list[dict[int, float]]) -> tuple[list[int], list[float], list[float], list[float]]:
    steps = sorted({s for ser in series_list for s in ser})
    xs, mean, lo, hi = [], [], [], []
    for s in steps:
        vals = [ser[s] for ser in series_list if s in ser and math.isfinite(ser[s])]
        if vals:
            xs.append(s)
            mean.append(statistics.fmean(vals))
            lo.append(min(vals))
            hi.append(max(vals))
    return xs, mean, lo, hi


def _smooth(ys: list[float], window: int) -> list[float]:
    if window <= 1:
        return ys
    out = []
    for i in range(len(ys)):
        part = ys[max(0, i - window + 1): i + 1]
        out.append(statistics.fmean(part))
    return out


def plot(groups: list[Group], out_dir: Path, smooth: int = 5) -> list[Path]:
    """curves.png (held-out accuracy per run and mean; reward) and diagnostics.png (M2 before/after masking,
    masked and clip fractions, ratio extremes), one colour per group; shaded: min..max over its runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    multi_model = len({g.model for g in groups}) > 1

    def name(g):
        return (f"{g.model} " if multi_model else "") + g.label

    paths = []
    fig, axes = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True)
    for i, g in enumerate(groups):
        c = colors[i % len(colors)]
        accs = [{s: row["avg"] for s, row in r.evals.items() if "avg" in row} for r in g.runs]
        for a in accs:
            if a:
                xs = sorted(a)
                axes[0].plot(xs, [a[s] for s in xs], color=c, alpha=0.3, linewidth=0.8)
        xs, mean, _, _ = _mean_curve(accs)
        if xs:
            axes[0].plot(xs, mean, color=c, linewidth=2, marker="o", markersize=3, label=f"{name(g)} (n={len(g.runs)})")
        xs, mean, lo, hi = _mean_curve([r.series.get("reward/mean", {}) for r in g.runs])
        if xs:
            axes[1].plot(xs, _smooth(mean, smooth), color=c, linewidth=1.5, label=name(g))
            axes[1].fill_between(xs, _smooth(lo, smooth), _smooth(hi, smooth), color=c, alpha=0.15)
    axes[0].set_title("held-out accuracy (benchmark average, pass@1 %): runs (thin) and mean (thick)", fontsize=10)
    axes[1].set_title(f"train reward (mean over runs, {smooth}-step moving average; band: min..max)", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    paths.append(out_dir / "curves.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(3, 2, figsize=(12, 9), sharex=True)
    for ax, (title, key, log) in zip(axes.flat, DIAGNOSTICS):
        for i, g in enumerate(groups):
            xs, mean, lo, hi = _mean_curve([r.series.get(key, {}) for r in g.runs])
            if not xs:
                continue
            c = colors[i % len(colors)]
            ax.plot(xs, _smooth(mean, smooth), color=c, linewidth=1.2, label=name(g))
            ax.fill_between(xs, _smooth(lo, smooth), _smooth(hi, smooth), color=c, alpha=0.12)
        ax.set_title(f"{title} ({key})", fontsize=9)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7, loc="best")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.tight_layout()
    paths.append(out_dir / "diagnostics.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def _run_note(r: RunRecord) -> str:
    """The run's directory, flagged when its metrics stop before train.steps (still running, or stopped)."""
    last = max((s for pts in r.series.values() for s in pts), default=0)
    steps = r.flat.get("train.steps")
    return f"{r.path}" + (f" (unfinished: step {last}/{steps})" if steps and last < int(steps) else "")


def make_report(dirs: Sequence[str | Path], out_dir: str | Path, plots: bool = True) -> dict[str, Path]:
    """Write report.md, report.csv (and curves.png, diagnostics.png) to out_dir; returns their paths."""
    records = [load_run(p) for p in find_runs(dirs)]
    groups = summarize(records)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "report.md"
    md.write_text(f"# Report of {len(records)} runs\n\n" + markdown(groups)
                  + "\nRuns:\n" + "".join(f"- {g.label}: {', '.join(_run_note(r) for r in g.runs)}\n" for g in groups))
    paths = {"markdown": md, "csv": write_csv(groups, out / "report.csv")}
    if plots:
        curves, diagnostics = plot(groups, out)
        paths.update(curves=curves, diagnostics=diagnostics)
    return paths
