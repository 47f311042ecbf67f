"""`m2po report DIR... [--out OUT]`: a Table-1 style report of runs as Markdown and CSV: held-out accuracy
per benchmark and their average, per method and staleness, as the score (the mean of each run's last 3
evaluations), at the last and at the best evaluation (chosen on the test set; optimistic), each cell the
mean over seeds ± its 95 % confidence interval; Welch's t-test of each stale group against on-policy GRPO
and stale GRPO, and a Claims section that reads them; and plots of accuracy, reward and the M2PO /
clipping diagnostics against step, as mean ± 95 % CI bands over seeds."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("report", help="Table-1 style report of runs with CIs and significance tests (Markdown, CSV, plots)", description=__doc__)
    p.add_argument("dirs", nargs="+", metavar="DIR",
                   help="run directories, or directories holding them (e.g. a sweep's output_dir)")
    p.add_argument("--out", default=None, help="output directory (default: DIR/report for one DIR, else ./report)")
    p.add_argument("--no-plots", action="store_true", help="tables only")
    p.add_argument("--calibration", action="store_true",
                   help="also the drift calibration of docs/reproduce.md (issue 34): the four pre-registered "
                        "criteria per cell (lr x mini-batch), each cell's horizon and cost, the chosen cell "
                        "(calibration.md, calibration.json)")
    p.set_defaults(func=run)


def run(args) -> int:
    import sys
    from pathlib import Path

    from m2po_megatron.sweep.report import ReportError, find_runs, load_run, make_report

    out = Path(args.out) if args.out else (Path(args.dirs[0]) / "report" if len(args.dirs) == 1 else Path("report"))
    try:
        paths = make_report(args.dirs, out, plots=not args.no_plots)
        if args.calibration:
            import json

            from m2po_megatron.sweep import calibration as cal

            cells = cal.cells([load_run(p) for p in find_runs(args.dirs)])
            paths["calibration"] = out / "calibration.md"
            paths["calibration"].write_text("# Drift calibration (docs/reproduce.md)\n\n" + cal.markdown(cells))
            paths["calibration_json"] = out / "calibration.json"
            paths["calibration_json"].write_text(json.dumps(cal.as_json(cells), indent=2) + "\n")
            if not args.no_plots:
                paths["calibration_png"] = out / "calibration.png"
                cal.figure(cells, paths["calibration_png"])
    except ReportError as e:
        print(f"m2po report: {e}", file=sys.stderr)
        return 2
    print(paths["markdown"].read_text())
    if "calibration" in paths:
        print(paths["calibration"].read_text())
    for p in paths.values():
        print(p)
    return 0
