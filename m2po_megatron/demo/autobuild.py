"""`m2po train` on a fresh clone: the tiny task a recipe trains is built before validation looks for it.

The CPU recipes (recipes/tiny-*.yaml, examples/countdown/recipe.yaml) train models the project builds itself
under the repository's `.cache/` (`m2po demo`, the Makefile's targets), whatever the working directory. When a
recipe's model.hf_path names one of those directories and it does not exist yet, `m2po train` builds it there
first, with the settings of the command that documents it, and says so in one line. Any other path, and a directory that is already there
(finished or not), is left to validation, which names what is missing and how to get it.

The build goes to a sibling directory renamed into place when done: an interrupted build leaves no half-built
task behind, and of two runs starting at once the second to finish keeps the first one's build.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class TinyBuild:
    """How one of the project's tiny tasks is built: the builder's keyword arguments, and the command that
    builds it by hand (named in the printed line)."""
    command: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    agent: bool = False  # build_tiny_agent_task instead of build_tiny_task
    moe: bool = False  # a tiny Qwen3-MoE (TinyMoeSpec())


# `m2po demo`'s task is warmed up to 40 % sampled accuracy: from 25 % (the builder's default, which the tests use)
# RL on this task learns too slowly for a 50-step demo to show it (docs/results/toy-table1.md, "How the settings were
# chosen"). commands/demo.py reads it from here.
DEMO_TARGET_ACCURACY = 0.4

# Directory name under .cache/ -> its build, as `m2po demo` and the Makefile make it.
BUILDS: dict[str, TinyBuild] = {
    "tiny-task": TinyBuild("`m2po demo`", {"seed": 0, "target_accuracy": DEMO_TARGET_ACCURACY}),
    "tiny-task-toy": TinyBuild("`make toy-table1`", {"seed": 0, "target_accuracy": 0.4}),
    "tiny-task-fair": TinyBuild("`make toy-table1-fair`", {
        "seed": 0, "target_accuracy": 0.35, "check_every": 10, "n_eval": 256, "n_train": 256,
        "disjoint_train": True, "uniform_splits": True}),
    "tiny-task-moe": TinyBuild("`make demo-moe`", {"seed": 0, "target_accuracy": 0.4}, moe=True),
    "tiny-agent-task": TinyBuild("`make demo-agent`", {"seed": 0}, agent=True),
}


def tiny_task_dir(hf_path: Optional[str], cwd: Optional[Path] = None, repo: Path = REPO) -> Optional[Path]:
    """The repository's .cache/<name> directory that model.hf_path names, when <name> is one of BUILDS and it
    does not exist (or is an empty directory); else None. A loaded config's hf_path is absolute when a recipe
    wrote it (config/paths.py: `.cache/...` in a recipe is the project's); a relative one was given on the
    command line and is the working directory's (`cwd`)."""
    if not hf_path:
        return None
    p = Path(os.path.expandvars(os.path.expanduser(str(hf_path))))
    p = ((cwd or Path.cwd()) / p).resolve()
    if p.parent != (repo / ".cache").resolve() or p.name not in BUILDS:
        return None
    if p.exists() and not (p.is_dir() and not any(p.iterdir())):
        return None  # there already: a build (finished or not) or the user's own files, never overwritten
    return p


def _say(line: str) -> None:
    print(line, flush=True)


def build_tiny_task_at(task_dir: Path, spec: TinyBuild, log: Callable[[str], Any] = _say) -> Path:
    """Build `spec` into `task_dir` through a temporary sibling renamed into place; returns `task_dir`."""
    from .tiny_model import TinyMoeSpec, build_tiny_task

    task_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{task_dir.name}.building-", dir=task_dir.parent))
    quiet = lambda *_: None  # noqa: E731 - the warm-up's per-check lines; the caller printed what happens
    try:
        if spec.agent:
            from .tiny_agent import build_tiny_agent_task

            build_tiny_agent_task(tmp, **spec.kwargs, log=quiet)
        else:
            build_tiny_task(tmp, **spec.kwargs, moe=TinyMoeSpec() if spec.moe else None, log=quiet)
        if task_dir.is_dir() and not any(task_dir.iterdir()):
            task_dir.rmdir()
        try:
            tmp.rename(task_dir)
        except OSError:
            if not task_dir.is_dir():
                raise
            log(f"[m2po] {task_dir} was built meanwhile by another run; using that one")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return task_dir


def build_missing_tiny_task(hf_path: Optional[str], cwd: Optional[Path] = None, repo: Path = REPO,
                            log: Callable[[str], Any] = _say) -> Optional[Path]:
    """Build the tiny task model.hf_path names when it is missing (see tiny_task_dir); returns the directory
    built, or None when there was nothing to build."""
    task_dir = tiny_task_dir(hf_path, cwd, repo)
    if task_dir is None:
        return None
    spec = BUILDS[task_dir.name]
    log(f"[m2po] model.hf_path {hf_path} does not exist: building the tiny task there first, as {spec.command} "
        f"does (once; about a minute on 2 cores)")
    return build_tiny_task_at(task_dir, spec, log)
