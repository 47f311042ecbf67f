"""Plot runs' metrics.jsonl (reward, accuracy, staleness against step), several runs overlaid."""
from __future__ import annotations

import fnmatch
import math
from pathlib import Path
from typing import Optional, Sequence, Union

from m2po_megatron.run.metrics import read_metrics

__all__ = ["DEFAULT_PANELS", "plot_runs", "read_metrics_file"]

PathLike = Union[str, Path]

# title -> key patterns, tried in order; the first pattern with data in any run fills the panel.
DEFAULT_PANELS: list[tuple[str, list[list[str]]]] = [
    ("reward", [["reward/mean"]]),
    ("accuracy (pass@1)", [["eval/avg"], ["eval/*/pass@1"]]),
    ("staleness (updates)", [["staleness/mean", "staleness/max"]]),
]


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


def plot_runs(run_dirs: Sequence[PathLike], out_path: PathLike, keys: Optional[Sequence[str]] = None) -> Path:
    """Write a PNG with one panel per metric group against step, each run a colour (labelled by its
    directory name). `keys`: one panel per entry, each a key or a glob such as 'eval/*/pass@1'; default:
    reward/mean, eval/avg (else eval/*/pass@1), staleness/mean and /max, skipping panels without data."""
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

    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.2 * len(panels)), sharex=True, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, ks) in zip(axes[:, 0], panels):
        for r, (series, label) in enumerate(zip(data, labels)):
            for j, k in enumerate(ks):
                pts = sorted((s, v) for s, v in series.get(k, {}).items() if math.isfinite(v))
                if not pts:
                    continue
                xs, ys = zip(*pts)
                name = label if len(ks) == 1 else f"{label}: {k}"
                ax.plot(xs, ys, styles[j % len(styles)], color=colors[r % len(colors)], label=name,
                        marker="o" if len(xs) < 30 else None, markersize=3)
        ax.set_title(title if len(ks) > 1 or title == ks[0] else f"{title}: {ks[0]}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
