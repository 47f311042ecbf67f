"""The numbers docs/training.md reports for issue 22's two experiments, read from their runs (nothing re-run):

    .venv/bin/python benchmarks/summarize_i22.py runs/rollout-correction runs/filter-groups [--img-dir docs/img]

- rollout correction (recipes/sweeps/rollout-correction.yaml): per arm the held-out accuracy at every
  evaluation step (mean over seeds), and for the corrected arms the per-step mismatch metrics over the run
  (rollout_corr/kl_k1, kl_k3, ratio p1/p99, truncated and masked fractions, ratio_parts/*): their mean, and
  the first and second halves' means (stable = the halves agree); a per-step plot of them.
- dynamic sampling (recipes/sweeps/filter-groups.yaml): the fraction of groups filtered, the extra generation
  (samples generated per step, on against off), accuracy at equal steps and at equal wall time (the
  accuracy each arm had reached when the slower arm's run ended ... interpolated on cumulative time/step),
  and the accounting identity checked at every step of every run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from m2po_megatron.run.metrics import read_metrics

MISMATCH = ("rollout_corr/kl_k1", "rollout_corr/kl_k3", "rollout_corr/ratio_p1", "rollout_corr/ratio_p99",
            "rollout_corr/truncated_frac", "rollout_corr/masked_frac", "ratio_parts/mismatch_m2",
            "ratio_parts/drift_m2")


def arms(sweep: Path, sep: str = "-") -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for d in sorted(p for p in sweep.iterdir() if (p / "metrics.jsonl").is_file()):
        out.setdefault(d.name.rsplit(sep, 1)[1], []).append(d)
    return out


def evals(run: Path) -> dict[int, float]:
    return {r["step"]: r["eval/avg/pass@1"] for r in read_metrics(run / "metrics.jsonl") if "eval/avg/pass@1" in r}


def steps(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "time/step" in r]


def accuracy_table(groups: dict[str, list[Path]]) -> None:
    at = sorted({s for runs in groups.values() for r in runs for s in evals(r)})
    print("| arm | " + " | ".join(f"step {s}" for s in at) + " |")
    print("|---|" + "---|" * len(at))
    for arm, runs in groups.items():
        cells = [statistics.fmean(evals(r)[s] for r in runs) for s in at]
        print(f"| {arm} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


def correction(sweep: Path, img: Path | None) -> None:
    groups = arms(sweep)
    print(f"## rollout correction ({sweep})")
    accuracy_table(groups)
    for arm, runs in groups.items():
        rows = [r for run in runs for r in steps(run)]
        if not any(MISMATCH[0] in r for r in rows):
            print(f"{arm}: no mismatch metrics (bypass makes no proximal pass)")
            continue
        for k in MISMATCH:
            vals = [[r[k] for r in steps(run) if k in r] for run in runs]
            half = [statistics.fmean(v[: len(v) // 2]) for v in vals], [statistics.fmean(v[len(v) // 2:]) for v in vals]
            print(f"{arm} {k}: mean {statistics.fmean(x for v in vals for x in v):.4g}, first half "
                  f"{statistics.fmean(half[0]):.4g}, second half {statistics.fmean(half[1]):.4g}, "
                  f"min {min(x for v in vals for x in v):.4g}, max {max(x for v in vals for x in v):.4g}")
    if img is not None:
        from m2po_megatron.sweep.plot import plot_runs

        runs = [r for arm, rs in groups.items() for r in rs if arm != "bypass"]
        print("plot:", plot_runs(runs, img / "rollout-correction-mismatch.png",
                                 keys=["rollout_corr/kl_k1", "rollout_corr/ratio_p99", "rollout_corr/masked_frac",
                                       "rollout_corr/truncated_frac", "eval/avg/pass@1", "staleness/mean"]))


def _at_time(run: Path, t: float) -> float:
    """Held-out accuracy at wall time t of the run (training time: the sum of time/step), linear between
    evaluations."""
    clock, acc = 0.0, []
    ev = evals(run)
    pts = [(0.0, ev[0])] if 0 in ev else []
    for r in steps(run):
        clock += r["time/step"]
        if r["step"] in ev:
            pts.append((clock, ev[r["step"]]))
    for (t0, a0), (t1, a1) in zip(pts, pts[1:]):
        if t0 <= t <= t1:
            return a0 + (a1 - a0) * (t - t0) / (t1 - t0)
    return pts[-1][1] if t > pts[-1][0] else pts[0][1]


def filtering(sweep: Path) -> None:
    groups = arms(sweep)
    print(f"## dynamic sampling ({sweep})")
    accuracy_table(groups)
    bad = 0
    for arm, runs in groups.items():
        rows = [r for run in runs for r in steps(run)]
        for r in rows:
            if r["samples/generated"] != r["samples/consumed"] + r["samples/dropped"] + r["samples/pending"]:
                bad += 1
        gen = [steps(run)[-1]["samples/generated"] / len(steps(run)) for run in runs]
        wall = [sum(r["time/step"] for r in steps(run)) for run in runs]
        line = (f"{arm}: generated {statistics.fmean(gen):.0f} samples/step, "
                f"training wall {statistics.fmean(wall):.0f} s")
        fg = [r for r in rows if "filter_groups/dropped_frac" in r]
        if fg:
            line += (f", groups filtered {100 * statistics.fmean(r['filter_groups/dropped_frac'] for r in fg):.1f} %"
                     f" (per step min {100 * min(r['filter_groups/dropped_frac'] for r in fg):.0f}, max "
                     f"{100 * max(r['filter_groups/dropped_frac'] for r in fg):.0f})"
                     f", steps short of the batch {sum(r['filter_groups/unfilled_groups'] > 0 for r in fg)}"
                     f" of {len(fg)} (rows without the metric: {len(rows) - len(fg)}), zero_variance dropped "
                     f"{sum(steps(run)[-1]['samples/dropped/zero_variance'] for run in runs)}")
        print(line)
    print(f"accounting identity broken at {bad} steps")
    names = list(groups)
    for i in range(len(groups[names[0]])):
        pair = [groups[a][i] for a in names]
        t = min(sum(r["time/step"] for r in steps(run)) for run in pair)
        print(f"seed {i + 1} at equal wall time {t:.0f} s: " + ", ".join(f"{a} {_at_time(run, t):.1f}"
                                                                       for a, run in zip(names, pair)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("correction_sweep", type=Path)
    ap.add_argument("filter_sweep", type=Path)
    ap.add_argument("--img-dir", type=Path, default=None, help="write the mismatch plot here")
    args = ap.parse_args()
    correction(args.correction_sweep, args.img_dir)
    filtering(args.filter_sweep)


if __name__ == "__main__":
    sys.exit(main())
