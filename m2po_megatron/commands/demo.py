"""`m2po demo`: the embedded default end to end on one CPU machine (what `make demo` runs).

Builds the tiny task once (tokenizer, warmed-up tiny Qwen2, synthetic train/eval data under .cache/),
trains it with recipes/tiny-cpu.yaml (two Megatron ranks over gloo and one CPU rollout server as Ray
actors, M2PO with a bounded staleness window, math-verify rewards), then plots the run and prints the
held-out accuracy before and after."""
from __future__ import annotations

from pathlib import Path

from m2po_megatron.demo.autobuild import DEMO_TARGET_ACCURACY  # one value for `m2po demo` and `m2po train`


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the embedded default (tiny model, CPU) end to end",
                       description=__doc__)
    p.add_argument("overrides", nargs="*", help="dotted overrides for recipes/tiny-cpu.yaml, e.g. train.steps=5")
    p.add_argument("--task-dir", default=".cache/tiny-task", help="where the tiny task is built (reused)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny task")
    p.set_defaults(func=run)


def task_is_current(task_dir: Path, seed: int, target_accuracy: float = DEMO_TARGET_ACCURACY) -> bool:
    """A built task that the demo can reuse: same seed and warm-up target (one built by an older demo is not)."""
    import json

    from m2po_megatron.demo.tiny_model import INFO_FILE

    try:
        info = json.loads((task_dir / INFO_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("seed") == seed and info.get("target_accuracy") == target_accuracy


def ensure_tiny_task(task_dir: str, seed: int) -> tuple[Path, bool]:
    """The demo's task directory, built unless a current build is there; and whether it was built now."""
    from m2po_megatron.demo.tiny_model import build_tiny_task

    out = Path(task_dir)
    if task_is_current(out, seed):
        return out, False
    print(f"[demo] building the tiny task in {out} (once; under a minute here)", flush=True)
    build_tiny_task(out, seed=seed, target_accuracy=DEMO_TARGET_ACCURACY)
    return out, True


def demo_overrides(task: Path, built_now: bool, user: list[str]) -> list[str]:
    """tiny-cpu on the task. run.resume=auto: a second `make demo` continues an interrupted demo or, finished,
    only reports it. A task built just now makes any earlier demo run stale (another model and data): that
    run is moved aside (run.overwrite=true keeps it as runs/tiny-cpu.replaced-TIME) and the demo starts over.
    The user's overrides come last and win."""
    fresh = ["run.overwrite=true"] if built_now else []
    return [f"model.hf_path={task}", f"data.train_path={task / 'train.jsonl'}",
            f"data.eval_paths=[{task / 'eval.jsonl'}]", "run.resume=auto", *fresh, *user]


def run(args) -> int:
    from m2po_megatron.config import load_config
    from m2po_megatron.run.metrics import read_metrics
    from m2po_megatron.sweep.plot import plot_runs
    from m2po_megatron.train import train

    task, built_now = ensure_tiny_task(args.task_dir, args.seed)
    cfg = load_config("tiny-cpu", demo_overrides(task, built_now, list(args.overrides)))
    rdir = train(cfg)
    png = plot_runs([rdir], rdir / "plot.png")
    rows = [r for r in read_metrics(rdir / "metrics.jsonl") if "eval/avg/pass@1" in r]
    if rows:
        print(f"[demo] held-out accuracy (avg@{cfg.eval.n_samples}): step {rows[0]['step']}: "
              f"{rows[0]['eval/avg/pass@1']:.1f}% -> step {rows[-1]['step']}: {rows[-1]['eval/avg/pass@1']:.1f}%")
    print(f"[demo] run directory {rdir}: config.yaml, metrics.jsonl, checkpoints/, {png.name}")
    return 0
