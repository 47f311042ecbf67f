"""`m2po report` sets the paper's Table 1 beside runs of a model, method and staleness that the paper ran."""
from __future__ import annotations

import json

import yaml

from m2po_megatron.sweep import paper_table1
from m2po_megatron.sweep.report import make_report

BENCHES = paper_table1.COLUMNS[:-1]


def _run(root, name, model, algo, lag, evals):
    """A run directory as `m2po train` leaves it: config.yaml and metrics.jsonl with eval rows."""
    d = root / name
    d.mkdir(parents=True)
    cfg = {"run": {"name": name, "seed": 42}, "model": {"hf_path": f"models/{model}"}, "algo": {"name": algo},
           "staleness": {"mode": "fixed_lag" if lag else "on_policy", "lag_steps": lag},
           "train": {"updates_per_step": 4, "steps": 100}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = [{"step": s, **{f"eval/{b}/pass@1": v for b, v in row.items()},
             "eval/avg/pass@1": sum(row.values()) / len(row)} for s, row in evals.items()]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_table_is_complete_and_its_avg_is_the_mean_of_the_benchmarks():
    assert len(paper_table1.ROWS) == 22  # 6 models x 4 arms, no GSPO for Qwen3-8B-Base and Qwen2.5-32B
    for key, row in paper_table1.ROWS.items():
        assert len(row) == len(paper_table1.COLUMNS), key
        assert abs(sum(row[:-1]) / 8 - row[-1]) < 0.1, key  # printed to one decimal


def test_report_shows_the_paper_beside_matching_runs(tmp_path):
    m2po = {b: 50.0 for b in BENCHES}
    _run(tmp_path, "m2po", "Qwen3-1.7B-Base", "m2po", 64, {0: {b: 1.0 for b in BENCHES}, 50: m2po,
                                                          100: {b: 40.0 for b in BENCHES}})
    _run(tmp_path, "grpo-notr", "Qwen3-1.7B-Base", "grpo_notr", 64, {50: m2po})  # not in the paper
    _run(tmp_path, "tiny", "Tiny-1", "grpo", 0, {50: m2po})                       # a model the paper did not run
    md = make_report([tmp_path], tmp_path / "r", plots=False)["markdown"].read_text()
    section = md[md.index("## Against the paper's Table 1"):]
    rows = [ln for ln in section.splitlines() if ln.startswith("| Qwen") or ln.startswith("| Tiny")]
    assert len(rows) == 1, rows
    cells = rows[0].split(" | ")
    assert cells[:3] == ["| Qwen3-1.7B-Base", "M2PO", "256"]
    # best eval (step 50, 50.0 each) / the paper's M2PO s=256 row for Qwen3-1.7B-Base
    assert cells[3] == "50.0 / 14" and cells[10] == "50.0 / 35.6" and cells[11] == "50.0 / 36.6"
    assert cells[12] == "+13.4 |"
    tiny_only = tmp_path / "tiny-only"
    _run(tiny_only, "tiny", "Tiny-1", "grpo", 0, {50: m2po})
    assert "Table 1" not in make_report([tiny_only], tmp_path / "r2", plots=False)["markdown"].read_text()
