"""A Table-1 style report of finished runs: held-out accuracy per method and staleness, over seeds, with
confidence intervals, significance tests against GRPO and a "Claims" section.

Each run directory holds the resolved `config.yaml` and `metrics.jsonl` that `m2po train` writes (eval rows
carry `eval/<benchmark>/pass@1` and `eval/avg/pass@1`, in percent; a run evaluated afterwards by `m2po eval`
may instead have `eval/summary.csv`). Runs are grouped by model, method (algo.name) and staleness (in
optimizer updates: lag_steps x updates_per_step for fixed_lag, 0 on-policy, `<=max_staleness` for bounded);
a run that a resume changed (`m2po train --allow-change`) is labelled by what ran, from its
config_history.jsonl ("m2po (steps 1-40) -> grpo (steps 41-60)"), so it is never counted as either method;
runs of one group that differ in anything but seeds, names and paths are split into variants, labelled by
what differs. Per run, the **score** is the mean of its last 3 evaluations after step 0 (fewer if it has
fewer; n_evals says how many), the headline and the only number the tests use; the **last** evaluation is
the last eval row, and the **best** the eval row with the highest benchmark average after step 0 (the
paper's checkpoint choice: chosen on the test set, so optimistic). Per group, each cell is the mean over
its runs with a 95 % Student-t interval (n - 1 dof), the sample standard deviation and n. Each stale group's
score is compared with on-policy GRPO and with stale GRPO at its staleness by Welch's t-test
(sweep/claims.py, sweep/stats.py); the plots (sweep/plot.py) show mean ± 95 % CI bands over seeds.
"""
from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import yaml

from m2po_megatron.sweep import claims as cl
from m2po_megatron.sweep import paper_table1, stats
from m2po_megatron.run.config_history import label_over_time
from m2po_megatron.run.metrics import metrics_path
from m2po_megatron.sweep.plot import plot_groups, read_metrics_file

METHOD_NAMES = {"grpo": "GRPO", "grpo_notr": "GRPO (no TR)", "gspo": "GSPO", "m2po": "M2PO"}
METHOD_ORDER = ["grpo", "grpo_notr", "gspo", "m2po"]
BENCH_ORDER = ["aime24", "aime25", "amc23", "amc24", "math500", "gaokao2023en", "minerva_math", "olympiadbench"]
# Config keys that do not make runs different experiments (seeds, names, paths, ports, logging).
IGNORED = ("run.", "logging.", "checkpoint.", "cluster.ray_", "rollout.host", "rollout.port", "rollout.urls",
           "rollout.api_key", "data.shuffle_seed", "model.hf_path", "model.tokenizer", "model.megatron_ckpt",
           "data.train_path", "data.eval_paths")


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
    def ci(self) -> stats.Interval:
        return stats.mean_ci(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values) if self.values else math.nan

    @property
    def std(self) -> float:
        return statistics.stdev(self.values) if len(self.values) > 1 else math.nan

    def text(self) -> str:
        """'mean ± half-width of the 95 % CI (n)'; one run: no interval."""
        if not self.values:
            return "-"
        return f"{self.mean:.1f}" + (f" ± {self.ci.half:.1f}" if self.n > 1 else "") + f" ({self.n})"


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
    score: dict[str, Cell] = field(default_factory=dict)  # mean of each run's last 3 evaluations after step 0
    n_evals: list[int] = field(default_factory=list)  # per run (in `runs` order): evaluations behind its score
    context: dict = field(default_factory=dict)  # config apart from algo.* and staleness.*, to match references

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
        if metrics_path(d).is_file():
            found.append(d)
            continue
        subs = sorted(p.parent for pat in ("*/metrics.jsonl", "*/*/metrics.jsonl", "*/metrics.jsonl.gz",
                                           "*/*/metrics.jsonl.gz") for p in d.glob(pat))
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
        series = read_metrics_file(metrics_path(run))
    except (OSError, ValueError) as e:
        raise ReportError(str(e)) from None
    seed = flat.get("run.seed")
    last = max((s for pts in series.values() for s in pts), default=0)

    def by_step(label):  # a resume that changed it (--allow-change): what ran when, from config_history.jsonl
        return label_over_time(run, lambda cfg: label(_flatten(cfg)), last) or label(flat)

    return RunRecord(path=run, model=by_step(_model), method=by_step(lambda f: str(f.get("algo.name", "?"))),
                     staleness=by_step(_staleness), seed=int(seed) if seed is not None else None, flat=flat,
                     evals=_evals(run, series), series=series)


# ----------------------------------------------------------------------------------------------------
# Grouping and statistics
# ----------------------------------------------------------------------------------------------------
def _relevant(flat: dict) -> dict:
    return {k: v for k, v in flat.items() if not k.startswith(IGNORED)}


def _context(flat: dict) -> dict:
    return {k: repr(v) for k, v in _relevant(flat).items() if not k.startswith(("algo.", "staleness."))}


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
        rs = sorted(rs, key=lambda r: (r.seed or 0, str(r.path)))
        last = {b: Cell() for b in benches}
        best = {b: Cell() for b in benches}
        score = {b: Cell() for b in benches}
        best_step, last_step, n_evals = Cell(), Cell(), []
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
            sc, n = stats.score(r.evals)
            n_evals.append(n)
            for b in benches:
                if b in sc:
                    score[b].values.append(sc[b])
        out.append(Group(model, method, s, variant, rs, last, best, best_step, last_step, score, n_evals,
                         _context(rs[0].flat)))

    def order(g: Group):
        s = g.staleness.lstrip("<=")
        m = METHOD_ORDER.index(g.method) if g.method in METHOD_ORDER else len(METHOD_ORDER)
        return g.model, float(s) if s.replace(".", "", 1).isdigit() else math.inf, m, g.method, g.variant

    return sorted(out, key=order)


# ----------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------
TITLES = {
    "score": f"score: the mean of each run's last {stats.SCORE_EVALS} evaluations after step 0 (fewer if it has "
             f"fewer; `evals`: how many)",
    "last": "at the last evaluation",
    "best": "at the best eval (chosen on the test set; optimistic): the highest benchmark average after step 0",
}


def _per_run(g: Group, when: str) -> str:
    vals = []
    for r in g.runs:
        if when == "score":
            v = stats.score(r.evals)[0].get("avg")
        else:
            ls, _ = last_and_best(r.evals)
            v = r.evals[ls].get("avg") if ls is not None else None
        vals.append("-" if v is None else f"{v:.1f}")
    return ", ".join(vals)


def markdown(groups: list[Group], comps: Optional[dict] = None) -> str:
    """The score table (with the Welch tests), the Claims section, and the last and best tables."""
    if not groups:
        return "(no runs)\n"
    comps = cl.compare(groups) if comps is None else comps
    benches = list(groups[0].last)
    multi_model = len({g.model for g in groups}) > 1
    head_cols = (["model"] if multi_model else []) + ["method", "s"]
    out = ["Cells: mean ± half-width of the 95 % confidence interval of the mean over runs (Student t, n - 1 "
           "dof), with n runs in brackets; one run, no interval (report.csv also has the standard deviation). Δ: the group's score (benchmark average) minus "
           "the reference's, [its 95 % CI] by Welch-Satterthwaite, and the two-sided p-value of Welch's t-test "
           "(* : the reference differs in config, see report.csv); n/a: no test, and why.\n"]
    for when in ("score", "last", "best"):
        out.append(f"Held-out pass@1 (%) {TITLES[when]}\n")
        cols = head_cols + [("Avg" if b == "avg" else b) for b in benches]
        cols += (["evals", "Avg per run (score)"] + [f"Δ vs {v}" for v in cl.REFS.values()] if when == "score"
                 else ["step"] + (["Avg per run (last)"] if when == "last" else []))
        out.append("| " + " | ".join(cols) + " |")
        out.append("|" + "---|" * len(cols))
        for g in groups:
            cells = getattr(g, when)
            row = ([g.model] if multi_model else []) + [
                METHOD_NAMES.get(g.method, g.method) + (f" ({g.variant})" if g.variant else ""), g.staleness]
            row += [cells[b].text() for b in benches]
            if when == "score":
                row.append(str(g.n_evals[0]) if len(set(g.n_evals)) == 1 else ", ".join(map(str, g.n_evals)))
                row.append(_per_run(g, when))
                row += [cl.cell(comps.get(id(g), {}).get(k)) for k in cl.REFS]  # "-": no such test
            else:
                step = g.last_step if when == "last" else g.best_step
                row.append(f"{step.mean:.0f}" if step.values else "-")
                if when == "last":
                    row.append(_per_run(g, when))
            out.append("| " + " | ".join(row) + " |")
        out.append("")
        if when == "score":
            text = cl.claims(groups, comps)
            if text:
                out.append(text)
    paper = paper_table1.markdown(groups)  # the paper's numbers beside the groups it also ran
    if paper:
        out.append(paper)
    return "\n".join(out)


def write_csv(groups: list[Group], path: Path, comps: Optional[dict] = None) -> Path:
    """Long format: one line per group x (score | last | best) x benchmark: mean, std, n, the 95 % interval
    (ci_half, ci_lo, ci_hi), n_evals (per run, score lines), the run values and directories, and for the
    score lines of stale groups the Welch tests against each reference (vs_onpolicy_*, vs_stale_grpo_*:
    reference label, diff, its CI lo and hi, dof, two-sided p, one-sided p for diff < 0, note)."""
    comps = cl.compare(groups) if comps is None else comps
    num = cl.fmt_num
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["model", "method", "staleness", "variant", "eval", "benchmark", "mean", "std", "n", "ci_half",
                    "ci_lo", "ci_hi", "n_evals", "values", "runs"] + cl.csv_columns())
        for g in groups:
            runs = ";".join(str(r.path) for r in g.runs)
            for when in ("score", "last", "best"):
                for b, c in getattr(g, when).items():
                    ci = c.ci
                    w.writerow([g.model, g.method, g.staleness, g.variant, when, b, num(ci.mean), num(ci.std), c.n,
                                num(ci.half), num(ci.lo), num(ci.hi),
                                ";".join(map(str, g.n_evals)) if when == "score" else "",
                                ";".join(f"{v:.6g}" for v in c.values), runs]
                               + (cl.csv_values(comps.get(id(g)), b) if when == "score" else cl.csv_values(None, b)))
    return path


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
    comps = cl.compare(groups)
    md = out / "report.md"
    md.write_text(f"# Report of {len(records)} runs\n\n" + markdown(groups, comps)
                  + "\nRuns:\n" + "".join(f"- {g.label}: {', '.join(_run_note(r) for r in g.runs)}\n" for g in groups))
    paths = {"markdown": md, "csv": write_csv(groups, out / "report.csv", comps)}
    if plots:
        curves, diagnostics = plot_groups(groups, out)
        paths.update(curves=curves, diagnostics=diagnostics)
    return paths
