"""m2po report on synthetic run directories with known values: grouping by method and staleness, last and
best evaluation, mean, sample std and 95 % interval over seeds, n per cell, variants, the CSV, the plots and
bad input (tests/test_report_stats.py: the score, the tests and the claims).
(tests/test_sweep_local.py runs it on real run directories.)"""
import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from m2po_megatron.sweep.report import ReportError, last_and_best, make_report

REPO = Path(__file__).resolve().parents[1]


def make_run(root: Path, name: str, algo: str, lag: int, seed: int, evals: dict, extra: dict | None = None,
             steps: int = 20, mode: str | None = None) -> Path:
    """A run directory as m2po train leaves it: config.yaml and metrics.jsonl (train rows every step, eval
    rows {step: {benchmark: pass@1}} with eval/avg/pass@1 their mean)."""
    d = root / name
    d.mkdir(parents=True)
    cfg = {"run": {"name": name, "output_dir": str(root), "seed": seed},
           "model": {"hf_path": "/models/Tiny-1"},
           "algo": {"name": algo, "m2po": {"tau": 0.04}},
           "staleness": {"mode": mode or ("fixed_lag" if lag else "on_policy"), "lag_steps": lag,
                         "max_staleness": 4},
           "train": {"updates_per_step": 4, "steps": steps}, "data": {"shuffle_seed": seed}}
    for path, value in (extra or {}).items():
        node = cfg
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = []
    for step in range(steps + 1):
        row = {"step": step}
        if step:
            row.update({"reward/mean": 0.1 * seed + 0.01 * step, "m2po/m2_before": 0.05, "m2po/m2_after": 0.03,
                        "m2po/masked_frac": 0.001, "clip_frac": 0.01, "ratio/max": 3.0, "ratio/min": 0.2})
        if step in evals:
            row.update({f"eval/{b}/pass@1": v for b, v in evals[step].items()})
            row["eval/avg/pass@1"] = sum(evals[step].values()) / len(evals[step])
        rows.append(json.dumps(row))
    (d / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    return d


@pytest.fixture()
def runs(tmp_path):
    root = tmp_path / "sweep"
    # GRPO s=0, three seeds; benchmarks a and b; evaluations at steps 0, 10, 20.
    make_run(root, "grpo-s0-1", "grpo", 0, 1, {0: {"a": 10, "b": 10}, 10: {"a": 30, "b": 40}, 20: {"a": 20, "b": 30}})
    make_run(root, "grpo-s0-2", "grpo", 0, 2, {0: {"a": 10, "b": 10}, 10: {"a": 40, "b": 40}, 20: {"a": 50, "b": 40}})
    make_run(root, "grpo-s0-3", "grpo", 0, 3, {0: {"a": 10, "b": 10}, 10: {"a": 20, "b": 20}, 20: {"a": 30, "b": 10}})
    # M2PO s=256 (lag 64 x 4 updates), two seeds; seed 2's last evaluation lacks benchmark b.
    make_run(root, "m2po-s256-1", "m2po", 64, 1, {0: {"a": 10, "b": 10}, 20: {"a": 36, "b": 44}})
    make_run(root, "m2po-s256-2", "m2po", 64, 2, {0: {"a": 10, "b": 10}, 20: {"a": 40}})
    # Same method and staleness but another tau: a variant of its own.
    make_run(root, "m2po-s256-tau", "m2po", 64, 1, {20: {"a": 1, "b": 3}}, extra={"algo.m2po.tau": 0.02})
    return root


M = "algo.m2po.tau=0.04"


def cells(path: Path) -> dict:
    with open(path) as f:
        return {(r["method"], r["staleness"], r["variant"], r["eval"], r["benchmark"]): r for r in csv.DictReader(f)}


def test_last_and_best_by_hand():
    evals = {0: {"avg": 90.0}, 10: {"avg": 20.0}, 20: {"avg": 30.0}, 30: {"avg": 30.0}, 40: {"avg": 25.0}}
    # Step 0 is the starting model, not a trained checkpoint; of 20 and 30 (tied at 30) the earlier wins.
    assert last_and_best(evals) == (40, 20)
    assert last_and_best({0: {"avg": 5.0}}) == (0, 0)
    assert last_and_best({}) == (None, None)


def test_table_values_against_hand_computed_means_and_stds(runs, tmp_path):
    paths = make_report([runs], tmp_path / "r")
    c = cells(paths["csv"])
    # GRPO s=0, last evaluation (step 20): a = 20, 50, 30 -> mean 33.333, sample std sqrt(700/3) = 15.275;
    # b = 30, 40, 10 -> mean 26.667, the same std; avg = 25, 45, 20 -> mean 30, std sqrt(350/2) = 13.229.
    last_a = c[("grpo", "0", "", "last", "a")]
    assert float(last_a["mean"]) == pytest.approx(100 / 3, abs=1e-4)
    assert float(last_a["std"]) == pytest.approx(math.sqrt(700 / 3), abs=1e-4)
    assert last_a["n"] == "3" and last_a["values"] == "20;50;30"
    last_avg = c[("grpo", "0", "", "last", "avg")]
    assert float(last_avg["mean"]) == pytest.approx(30.0)
    assert float(last_avg["std"]) == pytest.approx(math.sqrt(175), abs=1e-4)  # deviations -5, 15, -10
    # Best evaluation by the average after step 0: seed 1 step 10 (35 > 25), seed 2 step 20 (45 > 40),
    # seed 3 a tie (20 = 20) -> the earlier, step 10. a = 30, 50, 20 -> mean 33.333, std sqrt(700/3).
    best_a = c[("grpo", "0", "", "best", "a")]
    assert best_a["values"] == "30;50;20"
    assert float(best_a["std"]) == pytest.approx(math.sqrt(700 / 3), abs=1e-4)
    best_avg = c[("grpo", "0", "", "best", "avg")]
    assert best_avg["values"] == "35;45;20" and float(best_avg["mean"]) == pytest.approx(100 / 3, abs=1e-4)
    # M2PO s=256 (tau 0.04): benchmark b is behind one run only; its std is undefined (empty), a's is |40 - 36| / sqrt(2).
    assert c[("m2po", "256", M, "last", "b")]["n"] == "1" and c[("m2po", "256", M, "last", "b")]["std"] == ""
    assert float(c[("m2po", "256", M, "last", "a")]["std"]) == pytest.approx(4 / math.sqrt(2), abs=1e-4)
    assert c[("m2po", "256", M, "last", "avg")]["values"] == "40;40"  # (36 + 44) / 2 and 40 alone
    # The tau = 0.02 run is a variant; both are labelled by what differs.
    variant = c[("m2po", "256", "algo.m2po.tau=0.02", "last", "avg")]
    assert variant["n"] == "1" and variant["values"] == "2"


def table(md: str, title: str) -> list[str]:
    """The lines of the Markdown table whose title contains `title`."""
    part = md.split(title, 1)[1].split("\n\n", 2)[1]
    return [ln for ln in part.splitlines() if ln.startswith("| ")]


def test_markdown_rows_are_ordered_like_table_1(runs, tmp_path):
    md = make_report([runs], tmp_path / "r", plots=False)["markdown"].read_text()
    assert md.index("score: the mean of each run's last 3") < md.index("at the last evaluation") < md.index(
        "at the best eval (chosen on the test set; optimistic)")
    score = table(md, "score: the mean of each run's last 3")
    assert score[0] == ("| method | s | a | b | Avg | evals | Avg per run (score) | Δ vs on-policy GRPO | "
                        "Δ vs stale GRPO, same s |")
    lines = table(md, "at the last evaluation")
    # Cells are mean ± t_{0.975, n-1} x std / sqrt(n): GRPO a: 4.3027 x 15.275 / sqrt(3) = 37.9;
    # M2PO tau 0.04 a (36, 40): 12.706 x 2.828 / sqrt(2) = 25.4.
    assert lines[0].startswith("| method | s | a | b | Avg | step | Avg per run (last) |")
    assert lines[1].startswith("| GRPO | 0 | 33.3 ± 37.9 (3) | 26.7 ± 37.9 (3) | 30.0 ± 32.9 (3) | 20 | 25.0, 45.0, 20.0 |")
    assert lines[2].startswith("| M2PO (algo.m2po.tau=0.02) | 256 | 1.0 (1) | 3.0 (1) | 2.0 (1) | 20 | 2.0 |")
    assert lines[3].startswith("| M2PO (algo.m2po.tau=0.04) | 256 | 38.0 ± 25.4 (2) | 44.0 (1) | 40.0 ± 0.0 (2) | 20 |")
    assert [ln.split(" | ")[:2] for ln in table(md, "optimistic")[1:]] == [
        ["| GRPO", "0"], ["| M2PO (algo.m2po.tau=0.02)", "256"], ["| M2PO (algo.m2po.tau=0.04)", "256"]]


def test_a_resumed_run_counts_the_relogged_step_once(tmp_path):
    # A resumed run logs the steps after its checkpoint again: the later line wins, as in `m2po plot`.
    d = make_run(tmp_path, "r", "grpo", 0, 1, {10: {"a": 10}})
    with open(d / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 10, "eval/a/pass@1": 50.0, "eval/avg/pass@1": 50.0}) + "\n")
    c = cells(make_report([d], tmp_path / "out", plots=False)["csv"])
    assert c[("grpo", "0", "", "last", "a")]["values"] == "50"


def test_plots_and_cli(runs, tmp_path):
    p = subprocess.run([sys.executable, "-m", "m2po_megatron.cli", "report", str(runs), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert "| GRPO | 0 |" in p.stdout
    for png in ("curves.png", "diagnostics.png"):
        assert (tmp_path / "o" / png).stat().st_size > 10_000


def test_bad_input_names_the_file(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="no metrics.jsonl"):
        make_report([tmp_path / "empty"], tmp_path / "r")
    d = make_run(tmp_path, "noconfig", "grpo", 0, 1, {10: {"a": 1}})
    (d / "config.yaml").unlink()
    with pytest.raises(ReportError, match="config.yaml is missing"):
        make_report([d], tmp_path / "r")
    p = subprocess.run([sys.executable, "-m", "m2po_megatron.cli", "report", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 2 and "not a directory" in p.stderr


def test_a_paper_sweep_gets_a_model_column_and_the_papers_benchmark_order(tmp_path):
    benches = ["olympiadbench", "math500", "aime25", "minerva_math", "aime24", "amc24", "gaokao2023en", "amc23"]
    for model in ("Qwen3-1.7B-Base", "Qwen2.5-Math-7B"):
        for algo, lag in (("grpo", 0), ("m2po", 64)):
            make_run(tmp_path, f"table1-{model}-{algo}", algo, lag, 42, {50: {b: 10.0 for b in benches}},
                     extra={"model.hf_path": f"models/{model}"}, steps=50)
    md = make_report([tmp_path], tmp_path / "r", plots=False)["markdown"].read_text()
    lines = table(md, "at the last evaluation")
    assert lines[0].startswith("| model | method | s | aime24 | aime25 | amc23 | amc24 | math500 | gaokao2023en | "
                               "minerva_math | olympiadbench | Avg | step |")
    assert [ln.split(" | ")[:3] for ln in lines[1:5]] == [
        ["| Qwen2.5-Math-7B", "GRPO", "0"], ["| Qwen2.5-Math-7B", "M2PO", "256"],
        ["| Qwen3-1.7B-Base", "GRPO", "0"], ["| Qwen3-1.7B-Base", "M2PO", "256"]]


def test_unfinished_runs_are_flagged(tmp_path):
    make_run(tmp_path, "done", "grpo", 0, 1, {20: {"a": 1}}, steps=20)
    d = make_run(tmp_path, "running", "grpo", 0, 2, {10: {"a": 1}}, steps=12)
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    cfg["train"]["steps"] = 20  # its metrics stop at step 12 of 20
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    md = make_report([tmp_path], tmp_path / "r", plots=False)["markdown"].read_text()
    assert f"{d} (unfinished: step 12/20)" in md and f"{tmp_path / 'done'} (unfinished" not in md
