"""How well `m2po plan` predicts: calibrate the simulator on one real run of the embedded setup, then predict
runs it was not fitted on, and compare with what they measure.

The protocol is fixed here, before any result (issue 23): the calibration run is the demo's loop (tiny-cpu:
bounded, max_staleness 4, sync_interval 2, 2 updates per step, one CPU server, max_new_tokens 32); the
predicted runs vary one thing each, from bench_staleness's grid and beyond it: the staleness mode, the window
and sync interval, updates per step, the number of servers and the response length. Every run has
`--steps` steps (evaluation and checkpoints off); the first `--skip` are left out of both the measurement and
the prediction. The goal: step time and throughput within 15 %, mean staleness within 1 update.

This machine's speed wanders by 10-30 % from one minute to the next, so one run of a configuration against one
run of another measures the machine as much as the model. The measurement is therefore made in `--rounds`
rounds: each round runs the calibration configuration, calibrates on that one run, then runs every predicted
configuration in an order shuffled per round (seeded), each predicted from that round's calibration. A
configuration's error is the mean of its predictions over the rounds against the mean of its measurements:
each prediction still comes from one calibration run; the repetition only averages the machine's drift out of
the comparison. The first predicted configuration repeats the calibration's own: the noise left after
averaging, which no model can remove. Each round's own count within the goal is reported too.

    .venv/bin/python benchmarks/bench_plan.py [--steps 30] [--skip 3] [--rounds 3] [--only NAME ...] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
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
    return {k: {"predicted": pred[k], "measured": got[k]} for k in KEYS}


def errors(r: dict) -> dict:
    """Add the errors (predicted / measured - 1; staleness predicted - measured) and whether within the goal."""
    for k in ("step_s", "tokens_per_s"):
        r[k]["rel_error"] = r[k]["predicted"] / r[k]["measured"] - 1
    r["staleness_mean"]["abs_error"] = r["staleness_mean"]["predicted"] - r["staleness_mean"]["measured"]
    r["within_goal"] = (abs(r["step_s"]["rel_error"]) <= 0.15 and abs(r["tokens_per_s"]["rel_error"]) <= 0.15
                        and abs(r["staleness_mean"]["abs_error"]) <= 1.0)
    return r


def pooled(per_round: list[dict]) -> dict:
    """The mean over rounds of the predictions against the mean of the measurements, and the rounds' spread."""
    out = {k: {w: statistics.fmean(r[k][w] for r in per_round) for w in ("predicted", "measured")} for k in KEYS}
    steps = [r["step_s"]["measured"] for r in per_round]
    out["step_s"]["measured_spread"] = max(steps) / min(steps) - 1
    return errors(out)


def row(name: str, r: dict) -> str:
    s, t, st = r["step_s"], r["tokens_per_s"], r["staleness_mean"]
    spread = f" | {100 * s['measured_spread']:.0f} %" if "measured_spread" in s else ""
    return (f"| {name} | {s['predicted']:.3f} / {s['measured']:.3f} | {100 * s['rel_error']:+.1f} % | "
            f"{t['predicted']:.0f} / {t['measured']:.0f} | {100 * t['rel_error']:+.1f} % | "
            f"{st['predicted']:.2f} / {st['measured']:.2f} | {st['abs_error']:+.2f}{spread} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--task-dir", default=str(REPO / ".cache" / "tiny-task"))
    ap.add_argument("--only", nargs="+", default=None, help="predict only these configurations")
    ap.add_argument("--runs", default=None, help="keep the runs here (default: a temporary directory)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    from m2po_megatron.plan.calibrate import calibrate

    task = Path(args.task_dir)
    if not (task / "build_info.json").exists():
        raise SystemExit(f"no tiny task in {task}: run `m2po demo` (or make demo) once first")
    tmp = Path(args.runs or tempfile.mkdtemp(prefix="m2po-bench-plan-"))
    chosen = [p for p in PREDICTED if not args.only or p[0] in args.only]
    rounds: list[dict] = []
    for i in range(args.rounds):
        name, extra, u = CALIBRATION
        run_tiny(task, tmp, f"r{i}-{name}", args.steps, u, extra)
        cal = calibrate(tmp / f"r{i}-{name}", skip=args.skip)
        print(f"round {i} calibration:", json.dumps({k: round(v, 6) if isinstance(v, float) else v
                                                    for k, v in vars(cal.costs).items() if k != "source"}),
              flush=True)
        res = {"calibration": cal.to_dict(), "self": errors(compare(tmp / f"r{i}-{name}", cal, args.skip)),
               "predicted": {}}
        for pname, extra, u in random.Random(i).sample(chosen, len(chosen)):
            run_tiny(task, tmp, f"r{i}-{pname}", args.steps, u, extra)
            res["predicted"][pname] = r = errors(compare(tmp / f"r{i}-{pname}", cal, args.skip))
            print(f"round {i}", pname, json.dumps({k: ({kk: round(vv, 3) for kk, vv in v.items()}
                                                      if isinstance(v, dict) else v) for k, v in r.items()}),
                  flush=True)
        rounds.append(res)
        ok = sum(r["within_goal"] for r in res["predicted"].values())
        print(f"round {i}: within the goal {ok} of {len(res['predicted'])}", flush=True)
    result = {"rounds": rounds, "pooled": {p[0]: pooled([r["predicted"][p[0]] for r in rounds]) for p in chosen},
              "self": pooled([r["self"] for r in rounds]), "steps": args.steps, "skip": args.skip}
    print(f"\nthe mean of {args.rounds} rounds, each predicted from its own round's calibration run:")
    print("| configuration | step s (pred / meas) | error | tokens/s (pred / meas) | error | staleness mean "
          "(pred / meas) | error | step s spread over rounds |")
    print("|---|---|---|---|---|---|---|---|")
    print(row("calibration run (self)", result["self"]))
    for pname, r in result["pooled"].items():
        print(row(pname, r))
    ok = sum(r["within_goal"] for r in result["pooled"].values())
    print(f"within the goal (15 %, 1 update): {ok} of {len(result['pooled'])} predicted configurations; by round: "
          + ", ".join(str(sum(r["within_goal"] for r in rd["predicted"].values())) for rd in rounds))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
