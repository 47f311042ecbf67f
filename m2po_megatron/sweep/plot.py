"""Plot runs' metrics.jsonl against step: several runs overlaid (`m2po plot`: reward, accuracy, staleness), or
groups of runs as their mean with a shaded 95 % confidence band over seeds (`m2po report`: held-out accuracy,
train reward, and the M2PO / clipping diagnostics)."""
from __future__ import annotations

import fnmatch
import math
from pathlib import Path
from typing import Optional, Sequence, Union

from m2po_megatron.run.metrics import read_metrics

__all__ = ["DEFAULT_PANELS", "DIAGNOSTICS", "ci_band", "palette", "plot_groups", "plot_runs", "read_metrics_file",
           "runs_figure", "series_colors"]

PathLike = Union[str, Path]

# title -> key patterns, tried in order; the first pattern with data in any run fills the panel.
DEFAULT_PANELS: list[tuple[str, list[list[str]]]] = [
    ("reward", [["reward/mean"]]),
    ("accuracy (pass@1)", [["eval/avg"], ["eval/*/pass@1"]]),
    ("staleness (updates)", [["staleness/mean", "staleness/max"]]),
    # three-policy runs only (algo.rollout_correction): KL(behaviour || proximal) and what the correction did
    ("rollout correction: KL(behaviour || proximal)", [["rollout_corr/kl_k1", "rollout_corr/kl_k3"]]),
    ("rollout correction: truncated / masked fraction", [["rollout_corr/truncated_frac", "rollout_corr/masked_frac"]]),
    ("second moments: drift log(theta/p), mismatch log(p/b), total log(theta/b)",
     [["ratio_parts/drift_m2", "ratio_parts/mismatch_m2", "ratio_parts/total_m2"]]),
]


# The report's diagnostics panels: (title, metrics key, log scale).
DIAGNOSTICS = [("M2 before masking", "m2po/m2_before", False), ("M2 after masking", "m2po/m2_after", False),
               ("masked fraction", "m2po/masked_frac", False), ("clip fraction", "clip_frac", False),
               ("ratio max (all tokens)", "ratio/max", True), ("ratio min (all tokens)", "ratio/min", True),
               ("ratio max (kept tokens)", "ratio/kept_max", True), ("ratio min (kept tokens)", "ratio/kept_min", True),
               ("KL(behaviour || current), k3", "kl/k3", False),
               ("KL(behaviour || proximal), k3", "rollout_corr/kl_k3", False),
               ("proximal / behaviour, p99", "rollout_corr/ratio_p99", True),
               ("M2 of the drift log(theta/p)", "ratio_parts/drift_m2", False),
               ("M2 of the mismatch log(p/b)", "ratio_parts/mismatch_m2", False)]


def _number(v) -> Optional[float]:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and v.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(v)  # MetricsLogger writes non-finite floats as strings
    return None


def read_metrics_file(path: PathLike) -> dict[str, dict[int, float]]:
    """key -> {step: value} from a metrics.jsonl; a later line for the same step wins (a resumed run
    re-logs the steps after its checkpoint). A truncated last line only warns; other bad lines raise."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics file (expected RUN_DIR/metrics.jsonl)")
    series: dict[str, dict[int, float]] = {}
    for row in read_metrics(path):
        step = int(row["step"])
        for k, v in row.items():
            x = _number(v)
            if k != "step" and x is not None:
                series.setdefault(k, {})[step] = x
    return series


def _metrics_path(run: PathLike) -> Path:
    p = Path(run)
    return p if p.suffix == ".jsonl" else p / "metrics.jsonl"


def _labels(paths: list[Path]) -> list[str]:
    names = [p.parent.name for p in paths]
    if len(set(names)) == len(names):
        return names
    return [f"{p.parent.parent.name}/{p.parent.name}" for p in paths]


def palette(n: int) -> list:
    """n distinct colours: matplotlib's default cycle while it has enough (the usual look), then tab20, then
    evenly spaced hues of a colormap, so that no two series drawn together ever share a colour."""
    import matplotlib

    cycle = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    if n <= len(cycle):
        return list(cycle[:max(n, 1)])
    if n <= 20:
        return [matplotlib.colormaps["tab20"](i) for i in range(n)]
    return [matplotlib.colormaps["hsv"](i / n) for i in range(n)]


def series_colors(n_runs: int, n_keys: int, colors: Sequence) -> list[list]:
    """colors[r][j] for run r's key j in a panel of n_keys keys: a run's first key keeps the run's own colour
    (colors[r], the same in every panel), its other keys take colours after all the runs' (so every series of
    a panel has its own). `colors` needs n_runs x n_keys entries (see palette)."""
    return [[colors[r] if j == 0 else colors[n_runs + r * (n_keys - 1) + j - 1] for j in range(n_keys)]
            for r in range(n_runs)]


def runs_figure(run_dirs: Sequence[PathLike], keys: Optional[Sequence[str]] = None):
    """The matplotlib Figure plot_runs saves (one axis per panel); the caller closes it."""
    if not run_dirs:
        raise ValueError("plot_runs: give at least one run directory")
    paths = [_metrics_path(r) for r in run_dirs]
    data = [read_metrics_file(p) for p in paths]  # raises naming a missing file before any plotting
    labels = _labels(paths)
    available = sorted({k for d in data for k in d})

    def matching(patterns: list[str]) -> list[str]:
        return [k for k in available if any(fnmatch.fnmatchcase(k, pat) for pat in patterns)]

    panels: list[tuple[str, list[str]]] = []
    if keys:
        for pat in keys:
            found = matching([pat])
            if not found:
                raise ValueError(f"--keys {pat!r} matches no metric in {', '.join(map(str, paths))}; "
                                 f"available: {', '.join(available) or '(none)'}")
            panels.append((pat, found))
    else:
        for title, options in DEFAULT_PANELS:
            for patterns in options:
                found = matching(patterns)
                if found:
                    panels.append((title, found))
                    break
        if not panels:
            raise ValueError(f"no reward, eval or staleness metrics in {', '.join(map(str, paths))}; "
                             f"available: {', '.join(available) or '(none)'}; choose some with keys=")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = ["-", "--", ":", "-."]  # by key as well, for print in grey
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.2 * len(panels)), sharex=True, squeeze=False)
    colors = palette(len(data) * max(len(ks) for _, ks in panels))
    for ax, (title, ks) in zip(axes[:, 0], panels):
        by_series = series_colors(len(data), len(ks), colors)
        for r, (series, label) in enumerate(zip(data, labels)):
            for j, k in enumerate(ks):
                pts = sorted((s, v) for s, v in series.get(k, {}).items() if math.isfinite(v))
                if not pts:
                    continue
                xs, ys = zip(*pts)
                name = label if len(ks) == 1 else f"{label}: {k}"
                ax.plot(xs, ys, styles[j % len(styles)], color=by_series[r][j], label=name,
                        marker="o" if len(xs) < 30 else None, markersize=3)
        ax.set_title(title if len(ks) > 1 or title == ks[0] else f"{title}: {ks[0]}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    return fig


def plot_runs(run_dirs: Sequence[PathLike], out_path: PathLike, keys: Optional[Sequence[str]] = None) -> Path:
    """Write a PNG with one panel per metric group against step, each run a colour (labelled by its
    directory name) and every series of a panel a colour of its own. `keys`: one panel per entry, each a key
    or a glob such as 'eval/*/pass@1'; default: reward/mean, eval/avg (else eval/*/pass@1), staleness/mean
    and /max, skipping panels without data."""
    import matplotlib.pyplot as plt

    fig = runs_figure(run_dirs, keys)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# ----------------------------------------------------------------------------------------------------
# Groups of runs (m2po report)
# ----------------------------------------------------------------------------------------------------
def _smooth(series: dict[int, float], window: int) -> dict[int, float]:
    """A run's trailing moving average over its own finite points (smoothed per run, before the band, so
    the band is the interval of the smoothed curve)."""
    pts = sorted((s, v) for s, v in series.items() if math.isfinite(v))
    if window <= 1:
        return dict(pts)
    out = {}
    for i, (s, _) in enumerate(pts):
        part = [v for _, v in pts[max(0, i - window + 1): i + 1]]
        out[s] = sum(part) / len(part)
    return out


def ci_band(series_list: Sequence[dict[int, float]]) -> tuple[list[int], list[float], list[float], list[float]]:
    """(steps, mean, lo, hi) over the runs that have each step: the mean and its 95 % Student-t interval;
    lo = hi = nan where fewer than 2 runs have the step (no band there)."""
    from m2po_megatron.sweep.stats import mean_ci

    steps = sorted({s for ser in series_list for s in ser})
    xs, mean, lo, hi = [], [], [], []
    for s in steps:
        vals = [ser[s] for ser in series_list if s in ser and math.isfinite(ser[s])]
        if vals:
            ci = mean_ci(vals)
            xs.append(s)
            mean.append(ci.mean)
            lo.append(ci.lo)
            hi.append(ci.hi)
    return xs, mean, lo, hi


def _band(ax, series_list, color, label=None, log=False, **line):
    xs, mean, lo, hi = ci_band(series_list)
    if not xs:
        return
    if log:  # an interval reaching 0 or below has no place on a log axis: leave a gap there
        lo = [v if v > 0 else math.nan for v in lo]
    ax.plot(xs, mean, color=color, label=label, **line)
    ax.fill_between(xs, lo, hi, color=color, alpha=0.18, linewidth=0)


def plot_groups(groups, out_dir: PathLike, smooth: int = 5) -> list[Path]:
    """curves.png (held-out accuracy: runs thin, group mean thick; train reward) and diagnostics.png (M2
    before/after masking, masked and clip fractions, ratio extremes), one colour per group (anything with
    `runs` of RunRecords, `label` and `model`), each shaded with its 95 % CI over runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    colors = palette(len(groups))  # one per group, never repeated however many groups
    multi_model = len({g.model for g in groups}) > 1

    def name(g):
        return (f"{g.model} " if multi_model else "") + g.label

    paths = []
    fig, axes = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True)
    for i, g in enumerate(groups):
        c = colors[i]
        accs = [{s: row["avg"] for s, row in r.evals.items() if "avg" in row} for r in g.runs]
        for a in accs:
            if a:
                xs = sorted(a)
                axes[0].plot(xs, [a[s] for s in xs], color=c, alpha=0.3, linewidth=0.8)
        _band(axes[0], accs, c, f"{name(g)} (n={len(g.runs)})", linewidth=2, marker="o", markersize=3)
        _band(axes[1], [_smooth(r.series.get("reward/mean", {}), smooth) for r in g.runs], c, name(g),
              linewidth=1.5)
    axes[0].set_title("held-out accuracy (benchmark average, pass@1 %): runs (thin), mean and 95 % CI over runs",
                      fontsize=10)
    axes[1].set_title(f"train reward ({smooth}-step moving average per run): mean and 95 % CI over runs", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    paths.append(out_dir / "curves.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    # Panels of metrics no run logged (e.g. rollout correction in two-policy runs) are left out.
    diags = [d for d in DIAGNOSTICS if any(r.series.get(d[1]) for g in groups for r in g.runs)] or DIAGNOSTICS
    rows = (len(diags) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(12, 3 * rows), sharex=True, squeeze=False)
    for ax in axes.flat[len(diags):]:
        ax.set_visible(False)
    for ax, (title, key, log) in zip(axes.flat, diags):
        for i, g in enumerate(groups):
            _band(ax, [_smooth(r.series.get(key, {}), smooth) for r in g.runs], colors[i], name(g),
                  log=log, linewidth=1.2)
        ax.set_title(f"{title} ({key}; mean, 95 % CI)", fontsize=9)
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
