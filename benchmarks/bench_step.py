"""Where a tiny-cpu step's wall time goes, measured on the real run: `m2po train tiny-cpu` (local Ray, the
recipe's Megatron ranks, one CPU rollout server, the reward pool) for `--steps` steps; the first
`--skip` steps (start-up, compile and cache warm-up) are left out of the means.

    .venv/bin/python benchmarks/bench_step.py [--steps 8] [--skip 3] [--task-dir .cache/tiny-task]
        [--out FILE] [OVERRIDE ...]          # e.g. staleness.mode=on_policy
    .venv/bin/python benchmarks/bench_step.py --from RUN_DIR [--skip 3]   # an existing run's metrics.jsonl

Nothing is re-implemented: the parts are read from the run's metrics.jsonl. The loop records per step
`time/step` = `time/wait_rollout` + (batch building) + `time/train` + `time/weight_sync` + (stats); trainer
rank 0 reports its own seconds of the same step as `time/actor/*` (actor.actor.STEP_TIMES). A step is split
into parts that add up to `time/step` exactly:

- generation: the trainer's wait for rollouts. In the recipe's `bounded` mode generation and reward scoring
  run in a background thread and rollout process while the trainer trains, so this is only the part not
  hidden by training (the background reward seconds are printed apart); in `on_policy` mode it is the
  whole generation, and the reward pool's seconds are their own row.
- log-prob pass: the trainer's no-grad forward at the current weights for M2PO's batch-level mask. (The
  behaviour log-probs themselves come with the tokens from the rollout server in this recipe.)
- forward/backward: megatron's schedule with its gradient all-reduces; optimizer: optimizer + scheduler step.
- weight sync: pushing the weights to the server (every `staleness.sync_interval` steps; a mean per step).
- rest, as three remainders: Ray call and serialisation (the driver's `time/train` less the rank's
  `time/actor/train_step`: ray.put, argument transfer, result), actor other (the rank's call less its timed
  parts: batch validation, packing, metric reduction) and loop other (the step less the timed driver
  parts: batch building, ledger, generator stats).

Every process of the run carries a marker in its environment (or the run's session); any still there after
the run ends are named and stopped by pid. Also printed: CPU seconds per step of each group of processes.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# (key, label) in table order; every part is seconds per step, and they sum to time/step.
PARTS = [("generation", "generation (the trainer's wait for rollouts)"),
         ("reward", "reward"),
         ("logprob_pass", "log-prob pass (no-grad forward, M2PO mask)"),
         ("forward_backward", "forward/backward"),
         ("optimizer", "optimizer"),
         ("weight_sync", "weight sync"),
         ("ray_call", "rest: Ray call + serialisation"),
         ("actor_other", "rest: actor other (validation, packing, metrics)"),
         ("loop_other", "rest: loop other (batch building, ledger, stats)")]
ACTOR_KEYS = ("time/actor/train_step", "time/actor/logprob_pass", "time/actor/forward_backward",
              "time/actor/optimizer")
SERIAL_MODES = ("on_policy", "fixed_lag")  # generation and scoring run inside the trainer's wait


def step_parts(row: dict, serial: bool) -> dict[str, float]:
    """One metrics row -> seconds per part (PARTS), summing to the row's time/step. A step whose samples were
    all dropped trained nothing: its actor parts are 0."""
    g = lambda k: float(row.get(k, 0.0))  # noqa: E731
    step, wait, train, sync = g("time/step"), g("time/wait_rollout"), g("time/train"), g("time/weight_sync")
    actor = g("time/actor/train_step")
    lp, fb, opt = g("time/actor/logprob_pass"), g("time/actor/forward_backward"), g("time/actor/optimizer")
    reward = min(g("reward/seconds"), wait) if serial else 0.0
    return {"generation": wait - reward, "reward": reward, "logprob_pass": lp, "forward_backward": fb,
            "optimizer": opt, "weight_sync": sync, "ray_call": train - actor, "actor_other": actor - lp - fb - opt,
            "loop_other": step - wait - train - sync}


def train_rows(rows: list[dict]) -> list[dict]:
    """The rows of training steps (an evaluation-only row, step 0, has no time/step)."""
    return [r for r in rows if "time/step" in r]


def breakdown(rows: list[dict], skip: int, mode: str, dp: int = 1) -> dict:
    """Means over the training steps after the first `skip`: seconds per part, the step, tokens per second.
    `dp`: data-parallel ranks (num_microbatches counts all of theirs; rank 0 times its own)."""
    steps = train_rows(rows)
    if skip >= len(steps):
        raise SystemExit(f"--skip {skip} leaves none of the {len(steps)} training steps to measure; "
                         f"lower --skip or raise --steps")
    kept = steps[skip:]
    trained = [r for r in kept if "time/actor/train_step" in r]
    if not trained:
        raise SystemExit(f"none of the measured steps has {ACTOR_KEYS[0]}: the run predates the actor's step "
                         f"timers (or trained nothing); rerun it with this checkout")
    serial = mode in SERIAL_MODES
    per_step = [step_parts(r, serial) for r in kept]
    mean = lambda k: statistics.fmean(float(r.get(k, 0.0)) for r in kept)  # noqa: E731
    parts = {k: statistics.fmean(p[k] for p in per_step) for k, _ in PARTS}
    step_s = mean("time/step")
    tokens = mean("batch/tokens")
    return {"mode": mode, "steps": [int(r["step"]) for r in kept], "step_s": step_s,
            "step_s_min": min(float(r["time/step"]) for r in kept),
            "step_s_max": max(float(r["time/step"]) for r in kept),
            "parts_s": parts, "train_s": mean("time/train"), "tokens_per_step": tokens,
            "tokens_per_s": tokens / max(step_s, 1e-9), "tokens_per_train_s": tokens / max(mean("time/train"), 1e-9),
            "gen_tokens_per_s": mean("tokens_per_s/gen"), "microbatches_per_step": mean("num_microbatches") / dp,
            "background_reward_s": 0.0 if serial else mean("reward/seconds")}


def table(res: dict) -> str:
    s = res["step_s"]
    lines = [f"steps {res['steps'][0]}-{res['steps'][-1]} ({len(res['steps'])} steps, staleness.mode "
             f"{res['mode']}): {s:.2f} s per step (min {res['step_s_min']:.2f}, max {res['step_s_max']:.2f})",
             "", "| part | s / step | share |", "|---|---:|---:|"]
    for k, label in PARTS:
        v = res["parts_s"][k]
        lines.append(f"| {label} | {v:.3f} | {100 * v / max(s, 1e-9):.1f} % |")
    lines.append(f"| **step** | **{s:.3f}** | 100 % |")
    lines.append("")
    lines.append(f"trained tokens: {res['tokens_per_step']:.0f} per step, {res['tokens_per_s']:.0f} tokens/s of "
                 f"step time ({res['tokens_per_train_s']:.0f} per second of time/train); generation "
                 f"{res['gen_tokens_per_s']:.0f} tokens/s")
    n_mb = res["microbatches_per_step"]
    if n_mb:
        ms = lambda k: 1e3 * res["parts_s"][k] / n_mb  # noqa: E731
        lines.append(f"{n_mb:.1f} micro-batches per step on rank 0: "
                     f"forward/backward {ms('forward_backward'):.0f} ms and log-prob pass {ms('logprob_pass'):.0f} ms "
                     f"per micro-batch")
    if res["mode"] not in SERIAL_MODES:
        lines.append(f"background (overlapped with training, not in the sum): reward scoring "
                     f"{res['background_reward_s']:.3f} s per step")
    cpu = res.get("cpu_s_per_step")
    if cpu:
        total = sum(cpu.values())
        lines += ["", f"CPU seconds per measured step, by process ({total:.2f} in all = {total / max(s, 1e-9):.2f} "
                      f"of the {res.get('cpus')} CPUs busy on average):",
                  "", "| processes | CPU s / step |", "|---|---:|"]
        lines += [f"| {g} | {v:.2f} |" for g, v in cpu.items()]
    return "\n".join(lines)


def read_run(run: Path) -> tuple[list[dict], str, int]:
    """A run directory's metrics rows, staleness mode and data-parallel size (from its resolved config.yaml)."""
    import yaml

    from m2po_megatron.run.metrics import read_metrics

    metrics, cfg_path = run / "metrics.jsonl", run / "config.yaml"
    if not metrics.exists():
        raise SystemExit(f"{metrics} does not exist: --from takes a run directory of `m2po train`")
    cfg = (yaml.safe_load(cfg_path.read_text()) if cfg_path.exists() else None) or {}
    mode = (cfg.get("staleness") or {}).get("mode", "bounded")
    dp = int((cfg.get("parallel") or {}).get("data_parallel_size", 1))
    return read_metrics(metrics), mode, dp


# ------------------------------------------------------------------------------------------------------
# Running the real pipeline
# ------------------------------------------------------------------------------------------------------
MARKER_ENV = "M2PO_BENCH_STEP_RUN"  # inherited by every process of the run (the rollout server and the reaper
# start their own sessions; Ray's agents may overwrite the environment /proc shows, but keep the session)


def run_pids(marker: str, sid: int) -> list[int]:
    """Live processes of the run: in its session, or carrying its marker (Linux /proc; none elsewhere)."""
    needle, out = f"{MARKER_ENV}={marker}\0".encode(), []
    for d in Path("/proc").glob("[0-9]*"):
        if int(d.name) == os.getpid():
            continue
        try:
            fields = (d / "stat").read_text()
            fields = fields[fields.rindex(")") + 2:].split()  # state ppid pgrp session ...
            if fields[0] != "Z" and (int(fields[3]) == sid or needle in (d / "environ").read_bytes()):
                out.append(int(d.name))
        except (OSError, ValueError):
            continue
    return out


def stop_run(marker: str, sid: int, grace_s: float = 15.0) -> list[int]:
    """After the driver: wait `grace_s` for the run's processes to leave (its reaper sweeps them), then stop
    what is left by pid (SIGTERM, then SIGKILL after 10 s). Returns the pids that had to be stopped."""
    deadline = time.monotonic() + grace_s
    while run_pids(marker, sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = run_pids(marker, sid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in run_pids(marker, sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while run_pids(marker, sid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not run_pids(marker, sid):
            break
    return left


# Process -> group, by the command line Ray's processes show (ray::<Actor>...) or their module.
GROUPS = [("ray::TrainerWorker", "trainer ranks"), ("rollout.local_server", "rollout server (engine)"),
          ("m2po_megatron.cli", "driver (loop, generation thread)"), ("reward.worker", "reward workers"),
          ("ray::ServerActor", "rollout server actor"), ("", "Ray daemons and idle workers")]


def cpu_seconds(marker: str, sid: int) -> dict[int, tuple[str, float]]:
    """{pid: (group, user + system CPU seconds so far)} of the run's processes."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in run_pids(marker, sid):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = fields[fields.rindex(")") + 2:].split()
        group = next(g for key, g in GROUPS if key in cmd)
        out[pid] = (group, (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_by_group(first: dict, last: dict, steps: int) -> dict[str, float]:
    """CPU seconds per step of each group between two cpu_seconds() snapshots (a process started in between
    counts from 0; one that exited in between is not seen)."""
    out: dict[str, float] = {}
    for pid, (group, sec) in last.items():
        out[group] = out.get(group, 0.0) + (sec - first.get(pid, (group, 0.0))[1]) / steps
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def count_steps(metrics: Path) -> int:
    try:
        return metrics.read_text(errors="replace").count('"time/step"')
    except OSError:
        return 0


def run_train(task: Path, out: Path, steps: int, skip: int, overrides: list[str],
              timeout_s: float) -> tuple[Path, dict]:
    """Run `m2po train tiny-cpu` in its own session; returns the run directory and the CPU seconds per
    measured step of each process group (snapshots when step `skip` and step `steps` are logged)."""
    name = "bench-step"
    args = [f"model.hf_path={task}", f"data.train_path={task / 'train.jsonl'}", "data.eval_paths=[]",
            f"run.output_dir={out}", f"run.name={name}", f"train.steps={steps}", "checkpoint.interval=0",
            "eval.interval=0", *overrides]
    marker = uuid.uuid4().hex
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled", WANDB_MODE="disabled",
               **{MARKER_ENV: marker})
    log, metrics = out / "train.log", out / name / "metrics.jsonl"
    print(f"[bench_step] m2po train tiny-cpu {' '.join(args)}\n[bench_step] log: {log}", flush=True)
    snaps: dict[int, dict] = {}
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "m2po_megatron.cli", "train", "tiny-cpu", *args], env=env,
                             stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        try:
            while p.poll() is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the run took more than --timeout {timeout_s:.0f} s; see {log}")
                n = count_steps(metrics)
                for at in (skip, steps):
                    if n >= at and at not in snaps:
                        snaps[at] = cpu_seconds(marker, p.pid)
                time.sleep(0.25)
        except BaseException:  # timeout or Ctrl-C: the run and everything it started stop
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            stop_run(marker, p.pid)
            raise
    left = stop_run(marker, p.pid)
    if left:
        print(f"[bench_step] warning: the run left processes {left} behind; stopped them", flush=True)
    if p.returncode:
        raise SystemExit(f"the run failed (exit {p.returncode}); the end of {log}:\n"
                         + "\n".join(log.read_text(errors="replace").splitlines()[-40:]))
    cpu = cpu_by_group(snaps[skip], snaps[steps], steps - skip) if skip in snaps and steps in snaps else {}
    return out / name, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="dotted overrides of recipes/tiny-cpu.yaml for the run")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=3, help="first training steps left out of the means")
    ap.add_argument("--task-dir", default=str(REPO / ".cache" / "tiny-task"),
                    help="the tiny task: a finished build there (build_info.json) is used as it is, any "
                         "other is built as `m2po demo` builds its task")
    ap.add_argument("--from", dest="from_run", default=None, help="read this run directory instead of running")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds the run may take")
    ap.add_argument("--out", default=None, help="write the breakdown as JSON here")
    args = ap.parse_args()
    if args.from_run:
        rows, mode, dp = read_run(Path(args.from_run))
    else:
        if args.skip >= args.steps:
            raise SystemExit(f"--skip {args.skip} leaves none of the --steps {args.steps} steps to measure")
        from m2po_megatron.commands.demo import ensure_tiny_task

        task = Path(args.task_dir)
        if not (task / "build_info.json").is_file():  # never rebuild another task (e.g. the fair sweep's) as the demo's
            task, _ = ensure_tiny_task(args.task_dir, seed=0)
        tmp = Path(tempfile.mkdtemp(prefix="m2po-bench-step-"))
        run, cpu = run_train(task.resolve(), tmp, args.steps, args.skip, args.overrides, args.timeout)
        rows, mode, dp = read_run(run)
    res = breakdown(rows, args.skip, mode, dp)
    if not args.from_run:
        res["cpu_s_per_step"] = cpu
        res["cpus"] = os.cpu_count()
    print(table(res), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
