"""m2po_megatron.sweep.grid without Slurm: grid expansion, validation, the sbatch plan, status from run dirs;
and the paper recipes: each loads, validates and fits the per-GPU memory estimate under 80 GB."""
from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from m2po_megatron.sweep import grid as sw
from m2po_megatron.sweep import status as sweep_status

REPO = Path(__file__).resolve().parents[1]
PAPER = sorted((REPO / "recipes" / "paper").glob("*.yaml"))
MODELS = [p for p in PAPER if p.name != "base.yaml"]
LAYOUT_RECIPE = REPO / "tests" / "slurm" / "recipes" / "two-node.yaml"


def _write(tmp_path, text: str) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return p


def test_table1_expands_to_the_papers_22_runs():
    runs = sw.expand(sw.load_sweep(REPO / "recipes" / "sweeps" / "table1.yaml"))
    assert len(runs) == 22  # 6 models x 4 methods minus GSPO for the 8B and 32B models
    names = {r.name for r in runs}
    assert "table1-q3-8b-gspo-s256" not in names and "table1-q2.5-32b-gspo-s256" not in names
    r = next(r for r in runs if r.name == "table1-llama3b-m2po-s256")
    assert r.recipe == "recipes/paper/llama-3.2-3b-instruct.yaml"
    assert "algo.name=m2po" in r.overrides and "staleness.lag_steps=64" in r.overrides
    assert r.overrides[-1] == "run.name=table1-llama3b-m2po-s256"


def test_table1_validates_and_groups_runs_by_node_count():
    sweep = sw.load_sweep(REPO / "recipes" / "sweeps" / "table1.yaml")
    runs = sw.expand(sweep)
    sw.validate_runs(runs)  # the full config validation of every run, memory estimate included
    assert all(r.memory_gib and 0 < r.memory_gib["total"] < 80 for r in runs)
    out = io.StringIO()
    sw.submit(REPO / "recipes" / "sweeps" / "table1.yaml", dry_run=True, out=out)
    lines = [ln for ln in out.getvalue().splitlines() if "memory estimate per trainer GPU:" in ln]
    assert len(lines) == len(runs) and all(ln.endswith(" GiB") for ln in lines)  # one per run, in GiB
    assert {r.nodes for r in runs} == {2, 4}
    subs = sw.plan(sweep, runs, Path("/x"))
    assert [(s.kind, len(s.runs)) for s in subs] == [("array", 19), ("array", 3)]
    assert "--array=0-18%4" in subs[0].command and "--nodes=4" in subs[1].command
    assert "--gpus-per-node=8" in subs[0].command and "--time=48:00:00" in subs[0].command


@pytest.mark.parametrize("recipe", MODELS, ids=[p.stem for p in MODELS])
def test_paper_recipe_fits_80gb_per_gpu(recipe):
    from m2po_megatron.config import load_config, model_hf_config
    from m2po_megatron.config.validation import estimate_memory

    cfg = load_config(recipe, check_files=False)  # the weights are not on this machine
    hf = model_hf_config(cfg)
    assert hf is not None, "model.hf_config must point at the bundled config.json"
    p = cfg.parallel
    est = estimate_memory(cfg, hf)  # what `m2po config` estimates: recompute and expert parallelism included
    assert est["total"] < 80
    assert cfg.cluster.gpu_memory_gb == 80 and cfg.cluster.gpus_per_node == 8
    assert cfg.cluster.trainer_nodes * 8 == (p.tensor_model_parallel_size * p.pipeline_model_parallel_size
                                             * p.data_parallel_size)
    # the paper's hyperparameters survive inheritance
    assert (cfg.optim.lr, cfg.train.prompts_per_step, cfg.train.updates_per_step) == (1e-6, 256, 4)
    assert (cfg.algo.m2po.tau, cfg.rollout.n_samples_per_prompt, cfg.staleness.lag_steps) == (0.04, 8, 64)


def test_an_oversized_layout_is_rejected_by_validation():
    from m2po_megatron.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="gpu_memory_gb"):
        load_config(REPO / "recipes" / "paper" / "qwen2.5-32b.yaml",
                    ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
                     "parallel.data_parallel_size=16", "parallel.sequence_parallel=false"], check_files=False)


def test_runs_of_one_shape_share_an_array_and_a_lone_shape_is_a_job(tmp_path):
    p = _write(tmp_path, f"""
name: t
output_dir: {tmp_path}/out
overrides: [train.steps=2]
grid:
  model: {{m: {{recipe: {LAYOUT_RECIPE}}}}}
  method: {{a: [algo.name=grpo], b: [algo.name=m2po], c: [algo.name=gspo, cluster.rollout_nodes=0]}}
slurm: {{max_concurrent: 1, chain: 2, dependency: "afterok:7"}}
""")
    out = []

    class W:
        def write(self, s):
            out.append(s)

    manifest = sw.submit(p, dry_run=True, out=W())
    text = "".join(out)
    subs = manifest["submissions"]
    # 2 shapes x 2 chain segments; node count 1 (colocated c) and 2 (a, b)
    assert [(s["kind"], s["runs"], s["segment"]) for s in subs] == [
        ("job", ["t-m-c"], 0), ("array", ["t-m-a", "t-m-b"], 0),
        ("job", ["t-m-c"], 1), ("array", ["t-m-a", "t-m-b"], 1)]
    assert "--array=0-1%1" in subs[1]["command"]
    assert "--dependency=afterok:7" in subs[0]["command"]
    assert "--dependency=afterany:PREV" in subs[2]["command"]
    assert "--dependency=aftercorr:PREV" in subs[3]["command"]
    assert "task 1: t-m-b:" in text and "train.steps=2" in text
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


@pytest.mark.parametrize("body, message", [
    ("grid: {m: {a: [x=1]}}", "recipes"),
    ("grid: {m: [a, b]}", "must map value names"),
    ("grid: {m: {a: {recipe: X, extra: 1}}}", "unknown keys"),
    ("bogus: 1", "unknown keys"),
    ("slurm: {nodes: 3}\nrecipe: " + str(LAYOUT_RECIPE), "unknown slurm keys"),
    (f"recipe: {LAYOUT_RECIPE}\ngrid: {{m: {{a: [x=1]}}}}\nexclude: [{{m: a}}]", "no runs"),
])
def test_bad_sweep_files_say_what_is_wrong(tmp_path, body, message):
    with pytest.raises(sw.SweepError, match=message):
        sw.expand(sw.load_sweep(_write(tmp_path, body)))


def test_an_invalid_run_is_reported_before_anything_is_submitted(tmp_path):
    p = _write(tmp_path, f"recipe: {LAYOUT_RECIPE}\ngrid: {{m: {{good: [], bad: [train.steps=-1]}}}}\n")
    with pytest.raises(sw.SweepError, match=r"(?s)run s-bad .*train.steps = -1"):
        sw.submit(p, dry_run=True)


def test_status_reads_the_run_record_and_the_last_complete_metrics_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no squeue/sacct: state from the run's own record
    runs = []
    for name, state, metrics in [("a", "EXIT job=5 rc=0", ['{"step": 1}', '{"step": 2, "loss": 0.5}', '{"st']),
                                 ("b", "EXIT job=6 rc=3", []), ("c", None, None)]:
        d = tmp_path / name
        (d / "logs").mkdir(parents=True)
        if state:
            (d / "logs" / "job-state").write_text(f"START job=5\n{state}\n")
        if metrics is not None:
            (d / "metrics.jsonl").write_text("\n".join(metrics))
        runs.append({"name": name, "run_dir": str(d), "jobs": ["5"] if name != "c" else []})
    (tmp_path / sw.MANIFEST).write_text(json.dumps({"runs": runs}))
    rows = {r["run"]: r for r in sweep_status.status(tmp_path)}
    assert rows["a"]["state"] == "COMPLETED" and rows["a"]["metrics"] == {"step": 2, "loss": 0.5}
    assert rows["b"]["state"] == "FAILED(rc=3)" and rows["b"]["metrics"] is None
    assert rows["c"]["state"] == "NOT SUBMITTED"
    assert "loss=0.5" in sweep_status.format_status(list(rows.values()))


def test_layout_helper_prints_nodes_and_run_dir(tmp_path):
    res = subprocess.run([sys.executable, "-m", "m2po_megatron.sweep.grid", "layout", str(LAYOUT_RECIPE),
                          f"run.output_dir={tmp_path}", "cluster.trainer_nodes=3"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["3", "1", f"{tmp_path}/two-node"]
    bad = subprocess.run([sys.executable, "-m", "m2po_megatron.sweep.grid", "layout", str(LAYOUT_RECIPE),
                          "cluster.trainer_nodse=3"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert bad.returncode == 2 and "cluster.trainer_nodes" in bad.stderr
