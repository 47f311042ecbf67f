"""How well `m2po plan` predicts: calibrate the simulator on one real run of the embedded setup, then predict
runs it was not fitted on, and compare with what they measure.

The protocol is fixed here, before any result (issue 23): the calibration run is the demo's loop (tiny-cpu:
bounded, max_staleness 4, sync_interval 2, 2 updates per step, one CPU server, max_new_tokens 32); the
predicted runs vary one thing each, from bench_staleness's grid and beyond it: the staleness mode, the window
and sync interval, updates per step, the number of servers and the response length. Every run has
`--steps` steps (evaluation and checkpoints off); the first `--skip` are left out of both the measurement and
the prediction. The goal: step time and throughput within 15 %, mean staleness within 1 update. The first
predicted run repeats the calibration's own configuration: how far two runs of one configuration differ on
this machine, which no model can predict. With `--anchors` the calibration's configuration runs again after
every predicted run, and the errors are also given against the machine's speed at the time (ratios against a
baseline measured in the same session, as every benchmark here reports).

    .venv/bin/python benchmarks/bench_plan.py [--steps 20] [--skip 3] [--anchors] [--only NAME ...] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_staleness import REPO, run as run_tiny  # noqa: E402

CALIBRATION = ("bounded_s4", ["staleness.mode=bounded", "staleness.max_staleness=4", "staleness.sync_interval=2"], 2)
PREDICTED = [  # name, overrides, updates per step
    ("bounded_s4_repeat", CALIBRATION[1], 2),  # the calibration's own configuration again: the machine's noise
    ("on_policy", ["staleness.mode=on_policy"], 2),
    ("fixed_lag_1", ["staleness.mode=fixed_lag", "staleness.lag_steps=1"], 2),
    ("bounded_s1_u1", ["staleness.mode=bounded", "staleness.max_staleness=1", "staleness.sync_interval=1"], 1),
    ("bounded_s4_u1", ["staleness.mode=bounded", "staleness.max_staleness=4", "staleness.sync_interval=2"], 1),
    ("bounded_s8_si4", ["staleness.mode=bounded", "staleness.max_staleness=8", "staleness.sync_interval=4"], 2),
    ("bounded_s8_u4", ["staleness.mode=bounded", "staleness.max_staleness=8", "staleness.sync_interval=4"], 4),
    ("bounded_2servers", [*CALIBRATION[1], "rollout.num_servers=2"], 2),
    ("bounded_len16", [*CALIBRATION[1], "rollout.max_new_tokens=16"], 2),
]
KEYS = ("step_s", "tokens_per_s", "staleness_mean", "wait_s", "train_s")


def compare(run_dir: Path, cal, skip: int) -> dict:
    from m2po_megatron.config import load_config
    from m2po_megatron.plan.calibrate import measured, predict

    cfg = load_config(run_dir / "config.yaml", check_files=False)
    got, pred = measured(run_dir, skip), predict(cfg, cal, skip=skip)
    out = {k: {"predicted": pred[k], "measured": got[k]} for k in KEYS}
    for k in ("step_s", "tokens_per_s"):
        out[k]["rel_error"] = pred[k] / got[k] - 1
    out["staleness_mean"]["abs_error"] = pred["staleness_mean"] - got["staleness_mean"]
    out["within_goal"] = (abs(out["step_s"]["rel_error"]) <= 0.15 and abs(out["tokens_per_s"]["rel_error"]) <= 0.15
                          and abs(out["staleness_mean"]["abs_error"]) <= 1.0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--task-dir", default=str(REPO / ".cache" / "tiny-task"))
    ap.add_argument("--only", nargs="+", default=None, help="predict only these configurations")
    ap.add_argument("--runs", default=None, help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--anchors", action="store_true",
                    help="after each predicted run, run the calibration's configuration again; the mean of the "
                         "anchors before and after a run, over the calibration run's step time, is the machine's "
                         "drift, and the errors are also reported with the prediction scaled by it")
    args = ap.parse_args()
    from m2po_megatron.plan.calibrate import calibrate, measured

    task = Path(args.task_dir)
    if not (task / "build_info.json").exists():
        raise SystemExit(f"no tiny task in {task}: run `m2po demo` (or make demo) once first")
    tmp = Path(args.runs or tempfile.mkdtemp(prefix="m2po-bench-plan-"))
    name, extra, u = CALIBRATION
    run_tiny(task, tmp, name, args.steps, u, extra)
    cal = calibrate(tmp / name, skip=args.skip)
    print("calibration:", json.dumps({k: round(v, 6) if isinstance(v, float) else v
                                      for k, v in vars(cal.costs).items() if k != "source"}), flush=True)
    res = {"calibration": cal.to_dict(), "self": compare(tmp / name, cal, args.skip), "predicted": {}}
    base_step = res["self"]["step_s"]["measured"]
    before = base_step  # the latest anchor's step time (the calibration run to begin with)
    for pname, extra, u in PREDICTED:
        if args.only and pname not in args.only:
            continue
        run_tiny(task, tmp, pname, args.steps, u, extra)
        res["predicted"][pname] = r = compare(tmp / pname, cal, args.skip)
        if args.anchors:  # the calibration's configuration again, right after: the machine's speed now
            run_tiny(task, tmp, f"anchor-{pname}", args.steps, CALIBRATION[2], CALIBRATION[1])
            after = measured(tmp / f"anchor-{pname}", args.skip)["step_s"]
            drift = (before + after) / 2 / base_step  # > 1: the machine ran slower than at calibration
            r["drift"] = drift
            r["drift_corrected"] = {"step_s": r["step_s"]["predicted"] * drift / r["step_s"]["measured"] - 1,
                                    "tokens_per_s": r["tokens_per_s"]["predicted"] / drift
                                    / r["tokens_per_s"]["measured"] - 1}
            r["within_goal_drift_corrected"] = (abs(r["drift_corrected"]["step_s"]) <= 0.15 and abs(
                r["drift_corrected"]["tokens_per_s"]) <= 0.15 and abs(r["staleness_mean"]["abs_error"]) <= 1.0)
            before = after
        print(pname, json.dumps({k: ({kk: round(vv, 3) for kk, vv in v.items()} if isinstance(v, dict) else v)
                                 for k, v in r.items()}), flush=True)
    print("| configuration | step s (pred / meas) | error | tokens/s (pred / meas) | error | staleness mean "
          "(pred / meas) | error |")
    print("|---|---|---|---|---|---|---|")
    for pname, r in [("calibration run (self)", res["self"]), *res["predicted"].items()]:
        s, t, st = r["step_s"], r["tokens_per_s"], r["staleness_mean"]
        print(f"| {pname} | {s['predicted']:.2f} / {s['measured']:.2f} | {100 * s['rel_error']:+.1f} % | "
              f"{t['predicted']:.0f} / {t['measured']:.0f} | {100 * t['rel_error']:+.1f} % | "
              f"{st['predicted']:.2f} / {st['measured']:.2f} | {st['abs_error']:+.2f} |")
    ok = sum(r["within_goal"] for r in res["predicted"].values())
    print(f"within the goal (15 %, 1 update): {ok} of {len(res['predicted'])} predicted configurations")
    if args.anchors:
        print("| configuration | machine drift (anchors / calibration) | step s error, drift-corrected | "
              "tokens/s error, drift-corrected |")
        print("|---|---|---|---|")
        for pname, r in res["predicted"].items():
            d = r["drift_corrected"]
            print(f"| {pname} | {r['drift']:.3f} | {100 * d['step_s']:+.1f} % | {100 * d['tokens_per_s']:+.1f} % |")
        ok = sum(r["within_goal_drift_corrected"] for r in res["predicted"].values())
        print(f"within the goal after the drift correction: {ok} of {len(res['predicted'])}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
