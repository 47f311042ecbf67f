"""`m2po demo`: the embedded default end to end on one CPU machine (what `make demo` runs).

Builds the tiny task once (tokenizer, warmed-up tiny Qwen2, synthetic train/eval data under .cache/),
trains it with recipes/tiny-cpu.yaml (its Megatron ranks over gloo and its CPU rollout servers as Ray
actors, M2PO with a bounded staleness window, math-verify rewards), then plots the run and prints the
held-out accuracy before and after."""
from __future__ import annotations

import argparse
from pathlib import Path

from m2po_megatron.demo.autobuild import DEMO_TARGET_ACCURACY, REPO  # one value for `m2po demo` and `m2po train`

RECIPE = "tiny-cpu"  # under recipes/; the help reads its counts from it


def register(sub) -> None:
    p = sub.add_parser("demo", help="run the embedded default (tiny model, CPU) end to end", add_help=False,
                       description=__doc__)
    p.add_argument("-h", "--help", action=_RecipeHelp, help="show this help message (read from the recipe) and exit")
    p.add_argument("overrides", nargs="*", help="dotted overrides for recipes/tiny-cpu.yaml, e.g. train.steps=5")
    p.add_argument("--task-dir", default=str(REPO / ".cache" / "tiny-task"),  # the one recipes/tiny-cpu.yaml names
                   help="where the tiny task is built (reused; default: the project's .cache/tiny-task)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny task")
    p.set_defaults(func=run)


def describe(recipe=RECIPE) -> str:
    """The help text with the recipe's own counts: trainer ranks (tp x pp x cp x dp, as the actor builds them)
    and rollout servers, so that the help cannot drift from the recipe."""
    from m2po_megatron.config import ConfigError, load_config

    try:
        cfg = load_config(recipe, check_files=False)
    except (ConfigError, OSError) as e:  # the help still prints; it says why the counts are missing
        return f"{__doc__}\n\n(recipe {recipe}: {e})"
    p, r = cfg.parallel, cfg.rollout
    ranks = (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
             * p.data_parallel_size)
    servers = len(r.urls) or r.num_servers

    def n(k: int, what: str) -> str:
        return f"{k} {what}{'' if k == 1 else 's'}"

    layout = f"TP {p.tensor_model_parallel_size}, PP {p.pipeline_model_parallel_size}, DP {p.data_parallel_size}"
    return (f"{__doc__}\n\nThe recipe ({recipe}) as it is now: {n(ranks, 'Megatron rank')} ({layout}) and "
            f"{n(servers, 'rollout server')} ({r.engine}), {cfg.train.steps} steps of "
            f"{cfg.train.prompts_per_step} prompts x {r.n_samples_per_prompt} samples, algo {cfg.algo.name}, "
            f"staleness {cfg.staleness.mode}.")


class _RecipeHelp(argparse.Action):
    """-h/--help that reads the recipe only when asked (every other `m2po` call skips loading a config)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.description = describe()
        parser.print_help()
        parser.exit()


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
    cfg = load_config(RECIPE, demo_overrides(task, built_now, list(args.overrides)))
    rdir = train(cfg)
    png = plot_runs([rdir], rdir / "plot.png")
    rows = [r for r in read_metrics(rdir / "metrics.jsonl") if "eval/avg/pass@1" in r]
    if rows:
        print(f"[demo] held-out accuracy (avg@{cfg.eval.n_samples}): step {rows[0]['step']}: "
              f"{rows[0]['eval/avg/pass@1']:.1f}% -> step {rows[-1]['step']}: {rows[-1]['eval/avg/pass@1']:.1f}%")
    print(f"[demo] run directory {rdir}: config.yaml, metrics.jsonl, checkpoints/, {png.name}")
    return 0
