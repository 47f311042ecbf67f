"""`m2po plot RUN_DIR... [--out FILE] [--keys KEY...]`: reward, accuracy and staleness against step, and the
utilisation summary of each run's timeline (trace.json: busy and idle fractions per component)."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("plot", help="plot runs' metrics.jsonl (reward, accuracy, staleness) to a PNG",
                       description="Read RUN_DIR/metrics.jsonl of each run and write one PNG with a panel per "
                                   "metric against step, runs overlaid and labelled by directory name.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (or metrics.jsonl files)")
    p.add_argument("--out", default=None,
                   help="PNG to write (default: RUN_DIR/metrics.png for one run, ./runs.png for several)")
    p.add_argument("--keys", nargs="+", default=None, metavar="KEY",
                   help="one panel per key or glob, e.g. reward/mean 'eval/*/pass@1' staleness/max "
                        "(default: reward/mean, eval/avg, staleness/mean and staleness/max)")
    p.set_defaults(func=run)


def run(args) -> int:
    import sys
    from pathlib import Path

    from m2po_megatron.sweep.plot import plot_runs

    first = Path(args.run_dirs[0])
    first = first.parent if first.suffix == ".jsonl" else first
    out = args.out or (first / "metrics.png" if len(args.run_dirs) == 1 else Path("runs.png"))
    try:
        path = plot_runs(args.run_dirs, out, keys=args.keys)
    except (FileNotFoundError, ValueError) as e:
        print(f"m2po plot: {e}", file=sys.stderr)
        return 2
    print(path)
    from m2po_megatron.sweep.timeline import format_utilisation, utilisation

    for d in args.run_dirs:  # the utilisation summary of each run that has a timeline (trace.json)
        d = Path(d).parent if Path(d).suffix == ".jsonl" else Path(d)
        try:
            print(f"{d}: {format_utilisation(utilisation(d))}")
        except FileNotFoundError:
            continue
        except (ValueError, KeyError, TypeError) as e:
            print(f"m2po plot: {d}: the run timeline is unreadable ({e!r}); skipped", file=sys.stderr)
    return 0
