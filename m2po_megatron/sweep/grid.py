"""Sweeps: expand a grid of recipe variants into named runs, submit them to Slurm (or run them here:
sweep/local.py), report their state.

A sweep file (YAML; recipes/sweeps/table1.yaml is the full example):

    name: table1                      # prefix of the run names and the Slurm job name
    output_dir: runs/table1           # each run's directory is output_dir/<run name>
    overrides: [train.steps=1000]     # applied to every run (optional)
    grid:                             # axes; the runs are their cartesian product, in this order
      model:                          # value name -> a recipe and/or overrides
        qwen3-1.7b: {recipe: paper/qwen3-1.7b-base.yaml}
        qwen3-4b:   {recipe: paper/qwen3-4b-base.yaml}
      method:                         # a bare list is a list of overrides
        grpo-s0:   [algo.name=grpo, staleness.mode=on_policy]
        m2po-s256: {recipe: paper/variants/m2po-s256.yaml}
    exclude: [{model: qwen3-4b, method: grpo-s0}]   # optional
    slurm:                            # optional: sbatch settings shared by all runs
      time: "48:00:00"
      partition: gpu
      gpus_per_node: 8                # --gpus-per-node
      max_concurrent: 4               # array tasks (or lanes of separate jobs) running at once
      chain: 1                        # job segments per run, each after the previous one (afterany)
      dependency: null                # e.g. afterok:1234, added to the first segment
      args: []                        # any other sbatch arguments

Exactly one axis value per run may name a `recipe` (the run's base recipe); the others add overrides.
Paths in a sweep file follow the recipes' rule (config/paths.py, docs/training.md "Paths"): recipe references
resolve like `extends:` (relative to the sweep file, or the project for recipes/..., or a name under recipes/),
and so do the paths its overrides set (`model.hf_path=.cache/tiny-task-toy` is the project's); output_dir, an
output, is relative to the working directory. Each run is validated with the config loader before anything is
submitted. Runs with the same shape (node count) become one job
array (task i reads ARGS_DIR/i.args); a single run of a shape becomes a plain job.
"""
from __future__ import annotations

import itertools
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

REPO = Path(__file__).resolve().parents[2]
SBATCH_SCRIPT = REPO / "slurm" / "m2po.sbatch"
MANIFEST = "sweep-manifest.json"
SLURM_KEYS = {"time", "partition", "gpus_per_node", "max_concurrent", "chain", "dependency", "args",
              "account", "qos", "constraint"}


class SweepError(ValueError):
    """A sweep file is wrong; the message names the key and the fix."""


@dataclass
class Run:
    name: str
    recipe: str
    overrides: list[str]
    run_dir: str
    nodes: int = 0
    axes: dict[str, str] = field(default_factory=dict)
    memory_gib: Optional[dict] = None  # the per-GPU memory estimate of a trainer rank (config.estimate_memory)

    @property
    def argv(self) -> list[str]:
        """Arguments of slurm/m2po.sbatch (and of `m2po train`)."""
        return [self.recipe, *self.overrides]


@dataclass
class Submission:
    kind: str  # array | job
    runs: list[str]
    command: list[str]
    job_id: Optional[str] = None  # filled after sbatch; "<array id>" for arrays
    segment: int = 0


# ----------------------------------------------------------------------------------------------------
# Expansion
# ----------------------------------------------------------------------------------------------------
def load_sweep(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise SweepError(f"sweep file {p} not found")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise SweepError(f"{p}: a sweep file is a mapping (name, output_dir, grid, ...)")
    unknown = set(data) - {"name", "output_dir", "overrides", "grid", "exclude", "include", "slurm", "recipe"}
    if unknown:
        raise SweepError(f"{p}: unknown keys {sorted(unknown)}; allowed: name, output_dir, recipe, overrides, "
                         f"grid, exclude, include, slurm")
    bad = set(data.get("slurm") or {}) - SLURM_KEYS
    if bad:
        raise SweepError(f"{p}: unknown slurm keys {sorted(bad)}; allowed: {sorted(SLURM_KEYS)}")
    data["_path"] = str(p.resolve())
    return data


def _axis_value(axis: str, name: str, spec: Any, src: str) -> tuple[Optional[str], list[str]]:
    if spec is None:
        return None, []
    if isinstance(spec, str):
        spec = [spec]
    if isinstance(spec, list):
        return None, [str(s) for s in spec]
    if isinstance(spec, dict):
        extra = set(spec) - {"recipe", "overrides"}
        if extra:
            raise SweepError(f"{src}: grid.{axis}.{name} has unknown keys {sorted(extra)}; use recipe/overrides")
        ov = spec.get("overrides") or []
        return spec.get("recipe"), [str(s) for s in ([ov] if isinstance(ov, str) else ov)]
    raise SweepError(f"{src}: grid.{axis}.{name} must be a list of overrides or {{recipe, overrides}}")


def _resolve_recipe(ref: str, sweep_path: Path) -> str:
    """The recipe as the jobs name it: relative to the repository (they run in M2PO_HOME) when it is there."""
    from m2po_megatron.config import resolve_recipe_path

    p = resolve_recipe_path(ref, sweep_path.parent)
    try:
        return str(p.relative_to(REPO))
    except ValueError:
        return str(p)


def recipe_file(recipe: str) -> str:
    """A run's recipe as a path that holds from any working directory (Run.recipe is the repository's)."""
    return recipe if Path(recipe).is_absolute() else str(REPO / recipe)


def _file_overrides(items: list[str], sweep_path: Path) -> list[str]:
    """Overrides written in the sweep file, their paths resolved there (config/paths.py)."""
    from m2po_megatron.config.paths import resolve_override

    return [resolve_override(o, sweep_path.parent) for o in items]


def expand(sweep: dict) -> list[Run]:
    """The sweep's runs, in grid order, with their names, recipes, overrides and run directories."""
    src = sweep.get("_path", "<sweep>")
    sp = Path(src)
    name = str(sweep.get("name") or sp.stem)
    out_dir = str(Path(str(sweep.get("output_dir") or f"runs/{name}")).absolute())  # jobs run in M2PO_HOME
    common = _file_overrides([str(o) for o in (sweep.get("overrides") or [])], sp)
    grid = sweep.get("grid") or {}
    if not isinstance(grid, dict) or not grid:
        if not sweep.get("recipe"):
            raise SweepError(f"{src}: needs a grid (axis -> values) or a top-level recipe")
        grid = {}
    axes = list(grid)
    values = []
    for axis in axes:
        vals = grid[axis]
        if isinstance(vals, list):  # a list of plain values: `axis.path: [a, b]` style is not allowed
            raise SweepError(f"{src}: grid.{axis} must map value names to overrides/recipes, e.g. "
                             f"{{s0: [staleness.lag_steps=0], s256: [staleness.lag_steps=64]}}")
        values.append([(v, *_axis_value(axis, str(v), vals[v], src)) for v in vals])
    excludes = sweep.get("exclude") or []
    runs: list[Run] = []
    seen: set[str] = set()
    for combo in itertools.product(*values) if axes else [()]:
        picked = {axes[i]: str(c[0]) for i, c in enumerate(combo)}
        if any(all(picked.get(k) == str(v) for k, v in ex.items()) for ex in excludes):
            continue
        recipes = [c[1] for c in combo if c[1]] + ([sweep["recipe"]] if sweep.get("recipe") else [])
        if len(recipes) != 1:
            raise SweepError(f"{src}: run {picked} names {len(recipes)} recipes ({recipes}); exactly one axis "
                             f"value (or the top-level `recipe`) must give the recipe")
        run_name = "-".join([name, *picked.values()]) if picked else name
        if run_name in seen:
            raise SweepError(f"{src}: two runs are both named {run_name}; rename an axis value")
        seen.add(run_name)
        ov = common + _file_overrides([o for c in combo for o in c[2]], sp)
        run_dir = f"{out_dir}/{run_name}"
        ov += [f"run.output_dir={out_dir}", f"run.name={run_name}"]
        runs.append(Run(run_name, _resolve_recipe(str(recipes[0]), sp), ov, run_dir, axes=picked))
    for extra in sweep.get("include") or []:
        if not isinstance(extra, dict) or "name" not in extra or "recipe" not in extra:
            raise SweepError(f"{src}: each include entry needs name and recipe (and optional overrides)")
        run_name = f"{name}-{extra['name']}"
        ov = common + _file_overrides([str(o) for o in extra.get("overrides") or []], sp)
        ov += [f"run.output_dir={out_dir}", f"run.name={run_name}"]
        runs.append(Run(run_name, _resolve_recipe(str(extra["recipe"]), sp), ov, f"{out_dir}/{run_name}"))
    if not runs:
        raise SweepError(f"{src}: the grid and excludes leave no runs")
    return runs


def sweep_output_dir(sweep: dict, sweep_path: str | Path) -> Path:
    """The sweep's output_dir (default runs/<name>), absolute from the working directory as expand() does."""
    out = Path(str(sweep.get("output_dir") or f"runs/{sweep.get('name') or Path(sweep_path).stem}"))
    return out if out.is_absolute() else Path.cwd() / out


def layout(recipe: str, overrides: list[str]) -> tuple[int, int, str]:
    """(trainer nodes, rollout nodes, run directory) of a recipe + overrides, validated."""
    from m2po_megatron.config import load_config, run_dir

    cfg = load_config(recipe, overrides, check_files=False)
    return int(cfg.cluster.trainer_nodes), int(cfg.cluster.rollout_nodes), str(run_dir(cfg))


def validate_runs(runs: list[Run]) -> None:
    """Load every run's config (the full validation) and fill in its node count; all errors at once."""
    from m2po_megatron.config import ConfigError, estimate_memory, load_config

    errors = []
    for r in runs:
        try:
            cfg = load_config(recipe_file(r.recipe), r.overrides, check_files=False)
            r.nodes = int(cfg.cluster.trainer_nodes) + int(cfg.cluster.rollout_nodes)
            r.memory_gib = estimate_memory(cfg)
        except ConfigError as e:
            errors.append(f"run {r.name} ({r.recipe}): {e}")
    if errors:
        raise SweepError("invalid runs:\n" + "\n".join(errors))


# ----------------------------------------------------------------------------------------------------
# Submission
# ----------------------------------------------------------------------------------------------------
def _sbatch_common(slurm: dict, job_name: str) -> list[str]:
    cmd = ["sbatch", "--parsable", f"--job-name={job_name}"]
    for key, flag in (("time", "--time"), ("partition", "--partition"), ("account", "--account"),
                      ("qos", "--qos"), ("constraint", "--constraint"), ("gpus_per_node", "--gpus-per-node")):
        if slurm.get(key) not in (None, "", 0):
            cmd.append(f"{flag}={slurm[key]}")
    cmd += [str(a) for a in slurm.get("args") or []]
    return cmd


def plan(sweep: dict, runs: list[Run], out_dir: Path) -> list[Submission]:
    """The sbatch commands for the runs (without job ids and dependencies between segments)."""
    slurm = sweep.get("slurm") or {}
    name = str(sweep.get("name") or Path(sweep.get("_path", "sweep")).stem)
    cap = slurm.get("max_concurrent")
    subs: list[Submission] = []
    shapes: dict[int, list[Run]] = {}
    for r in runs:
        shapes.setdefault(r.nodes, []).append(r)
    for nodes, group in sorted(shapes.items()):
        base = _sbatch_common(slurm, name) + [f"--nodes={nodes}", "--ntasks-per-node=1"]
        if len(group) > 1:
            args_dir = out_dir / "slurm" / f"array-{nodes}n"
            arr = f"0-{len(group) - 1}" + (f"%{cap}" if cap else "")
            cmd = base + [f"--array={arr}", f"--output={out_dir}/slurm/{name}-{nodes}n-%A_%a.out",
                          f"--export=ALL,M2PO_HOME={REPO},M2PO_ARGS_DIR={args_dir}", str(SBATCH_SCRIPT)]
            subs.append(Submission("array", [r.name for r in group], cmd))
        else:
            r = group[0]
            cmd = base + [f"--output={out_dir}/slurm/{r.name}-%j.out", f"--export=ALL,M2PO_HOME={REPO}",
                          str(SBATCH_SCRIPT), *r.argv]
            subs.append(Submission("job", [r.name], cmd))
    return subs


def _with_dependency(cmd: list[str], dep: Optional[str]) -> list[str]:
    if not dep:
        return cmd
    i = cmd.index(str(SBATCH_SCRIPT))
    return cmd[:i] + [f"--dependency={dep}"] + cmd[i:]


def submit(sweep_path: str | Path, dry_run: bool = False, out=None) -> dict:
    """Expand, validate and submit a sweep; write its manifest. Returns the manifest."""
    out = out or sys.stdout  # read at call time: a default bound at import keeps a replaced sys.stdout
    sweep = load_sweep(sweep_path)
    runs = expand(sweep)
    validate_runs(runs)
    slurm = sweep.get("slurm") or {}
    out_dir = sweep_output_dir(sweep, sweep_path)
    subs = plan(sweep, runs, out_dir)
    chain = int(slurm.get("chain") or 1)
    cap = slurm.get("max_concurrent")
    by_name = {r.name: r for r in runs}

    if not dry_run:
        for s in subs:
            if s.kind == "array":
                args_dir = out_dir / "slurm" / f"array-{by_name[s.runs[0]].nodes}n"
                args_dir.mkdir(parents=True, exist_ok=True)
                for i, rn in enumerate(s.runs):
                    (args_dir / f"{i}.args").write_text("\n".join(by_name[rn].argv) + "\n")
        (out_dir / "slurm").mkdir(parents=True, exist_ok=True)

    submitted: list[Submission] = []
    lanes: list[Optional[str]] = []  # separate jobs: at most `cap` run at once, via afterany chains
    for seg in range(chain):
        for idx, s in enumerate(subs):
            deps = []
            if seg == 0 and slurm.get("dependency"):
                deps.append(str(slurm["dependency"]))
            if seg > 0:  # the previous segment of the same runs (arrays: task by task)
                prev = submitted[(seg - 1) * len(subs) + idx].job_id or "PREV"
                deps.append(f"{'aftercorr' if s.kind == 'array' else 'afterany'}:{prev}")
            if s.kind == "job" and cap and seg == 0:
                n_jobs = sum(1 for x in subs[:idx] if x.kind == "job")
                if n_jobs >= int(cap):
                    deps.append(f"afterany:{lanes[n_jobs - int(cap)] or 'PREV'}")
            cmd = _with_dependency(list(s.command), ",".join(deps) or None)
            sub = Submission(s.kind, s.runs, cmd, segment=seg)
            print(("DRY-RUN " if dry_run else "") + shlex.join(cmd), file=out)
            if seg == 0:
                for i, rn in enumerate(s.runs):
                    label = f"task {i}" if s.kind == "array" else "run"
                    print(f"    {label}: {rn}: {shlex.join(by_name[rn].argv)}", file=out)
                    if by_name[rn].memory_gib:
                        from m2po_megatron.models.memory import format_estimate

                        print(f"        memory estimate per trainer GPU: {format_estimate(by_name[rn].memory_gib)}",
                              file=out)
            if not dry_run:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
                if res.returncode != 0:
                    raise SweepError(f"sbatch failed ({res.returncode}): {res.stderr.strip()}\n  {shlex.join(cmd)}")
                sub.job_id = res.stdout.strip().split(";")[0]
                print(f"  -> job {sub.job_id} ({s.kind} of {len(s.runs)}: {', '.join(s.runs)})", file=out)
            submitted.append(sub)
            if s.kind == "job" and seg == 0:
                lanes.append(sub.job_id)

    manifest = {
        "sweep": str(sweep.get("name") or Path(sweep_path).stem),
        "sweep_file": str(Path(sweep_path).resolve()),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "dry_run": dry_run,
        "output_dir": str(out_dir),
        "runs": [],
        "submissions": [asdict(s) for s in submitted],
    }
    for r in runs:
        entry = asdict(r)
        entry["run_dir"] = str(out_dir / r.name)
        entry["jobs"] = []
        for s in submitted:
            if r.name in s.runs and s.job_id:
                entry["jobs"].append(f"{s.job_id}_{s.runs.index(r.name)}" if s.kind == "array" else s.job_id)
        manifest["runs"].append(entry)
    if not dry_run:
        path = out_dir / MANIFEST
        path.write_text(json.dumps(manifest, indent=2) + "\n")
        print(f"manifest: {path}", file=out)
    return manifest


# ----------------------------------------------------------------------------------------------------
# Status
# ----------------------------------------------------------------------------------------------------
def find_manifest(target: str | Path) -> Path:
    """A manifest from its path, its directory, or the sweep file that wrote it."""
    p = Path(target)
    if p.is_dir():
        p = p / MANIFEST
    elif p.suffix in (".yaml", ".yml"):
        p = sweep_output_dir(load_sweep(p), p) / MANIFEST
    if not p.is_file():
        raise SweepError(f"no sweep manifest at {p}; start the sweep first (m2po sweep SWEEP.yaml [--local])")
    return p


def last_metrics(run_dir: Path) -> Optional[dict]:
    """The last row of RUN_DIR/metrics.jsonl (run.metrics.read_metrics: a partially written last line is
    skipped); None when there is none or the file is damaged (the run's own reader names the line)."""
    from m2po_megatron.run.metrics import metrics_path, read_metrics

    f = metrics_path(run_dir)
    try:
        rows = read_metrics(f) if f.is_file() else []
    except ValueError:
        return None
    return rows[-1] if rows else None


# ----------------------------------------------------------------------------------------------------
# `python -m m2po_megatron.sweep.grid layout RECIPE [OVERRIDES...]` (used by slurm/m2po.sbatch)
# ----------------------------------------------------------------------------------------------------
def _main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "layout":
        from m2po_megatron.config import ConfigError

        try:
            t, r, d = layout(argv[1], argv[2:])
        except ConfigError as e:
            print(f"m2po layout: {e}", file=sys.stderr)
            return 2
        if any(c.isspace() for c in d):
            print(f"m2po layout: the run directory {d!r} contains white space; rename it", file=sys.stderr)
            return 2
        print(t, r, d)
        return 0
    print("usage: python -m m2po_megatron.sweep.grid layout RECIPE [OVERRIDES...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(_main(sys.argv[1:]))
