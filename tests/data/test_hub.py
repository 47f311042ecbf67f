"""The eight benchmarks through the real fetch path, offline: recorded upstream rows in an HF cache read by
huggingface_hub.snapshot_download and datasets, normalised, and compared with the reference copies'
answers and ids (tests/data/fixtures/hub/expected, taken from the workplace's eval_normalized)."""
from __future__ import annotations

import json

import pytest

from _hub_cache import FIXTURES, fill_cache
from m2po_megatron.data import hub
from m2po_megatron.data.prepare import EVAL_SETS


def _expected(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / "expected" / f"{name}.jsonl").read_text().splitlines()]


def test_every_paper_benchmark_has_a_source():
    assert set(hub.BENCHMARKS) == set(EVAL_SETS)


def test_fetch_and_normalise_all_eight_offline(tmp_path, monkeypatch):
    fill_cache(tmp_path, monkeypatch)
    got = {}
    for name in EVAL_SETS:
        rows = got[name] = hub.fetch_benchmark(name)
        exp = _expected(name)
        assert [r["id"] for r in rows] == [e["id"] for e in exp], name
        assert [r["answer"] for r in rows] == [e["answer"] for e in exp], name
        for r, e in zip(rows, exp):
            assert isinstance(r["problem"], str) and r["problem"].strip(), (name, r["id"])
            if "problem" in e:  # aime25 row 18: JSON-unescaped \frac repaired as in the reference copy
                assert r["problem"] == e["problem"], (name, r["id"])
    # the rows the rules exist for
    assert got["aime24"][1]["answer"] == "25"      # upstream "025"
    assert got["amc23"][0]["answer"] == "27"       # upstream 27.0
    gk = got["gaokao2023en"]
    assert [r.get("answer_recovered_from_question_text", False) for r in gk] == [False, False, True, True]
    assert got["aime25"][2]["problem_text_repaired"] is True
    # the pinned file is cached by checksum: fetched again, it needs no network (the source is gone now)
    gone = hub.Benchmark(**{**hub.BENCHMARKS["gaokao2023en"].__dict__,
                            "source": (tmp_path / "gone" / "gaokao-2023en-test.jsonl").as_uri()})
    monkeypatch.setitem(hub.BENCHMARKS, "gaokao2023en", gone)
    assert [r["answer"] for r in hub.fetch_benchmark("gaokao2023en")] == [r["answer"] for r in gk]
    monkeypatch.setenv("M2PO_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(hub.HubError, match="gaokao2023en: could not download .*offline, put the file at"):
        hub.fetch_benchmark("gaokao2023en")


def test_answer_rules():
    assert hub.answer_text("025", "integer") == "25" and hub.answer_text(0, "integer") == "0"
    assert hub.answer_text(27.0, "number") == "27" and hub.answer_text("2.50", "number") == "2.50"
    assert hub.answer_text(["$x=1$", "$2$"], "first_no_dollar") == "x=1"
    assert hub.answer_text("$-1-\\sqrt{3}$", "no_dollar") == "-1-\\sqrt{3}"
    assert hub.answer_text("", "text") is None and hub.answer_text([], "first_no_dollar") is None


def test_wrong_checksum_and_missing_cache_are_clear(tmp_path, monkeypatch):
    fill_cache(tmp_path, monkeypatch)
    gk = hub.BENCHMARKS["gaokao2023en"]
    monkeypatch.setitem(hub.BENCHMARKS, "gaokao2023en", hub.Benchmark(**{**gk.__dict__, "sha256": "0" * 64}))
    with pytest.raises(hub.HubError, match="sha256 .* expected 0{64}: not the file"):
        hub.fetch_benchmark("gaokao2023en")
    monkeypatch.setitem(hub.BENCHMARKS, "math500", hub.Benchmark(**{**hub.BENCHMARKS["math500"].__dict__,
                                                                      "source": "nobody/not-cached"}))
    with pytest.raises(hub.HubError, match="math500: could not get Hugging Face dataset nobody/not-cached.*--eval-dir"):
        hub.fetch_benchmark("math500")


def test_prepare_data_eval_hub_writes_prompts_and_refuses_unknown_sets(tmp_path, monkeypatch, capsys):
    from m2po_megatron.cli import main

    fill_cache(tmp_path, monkeypatch)
    out = tmp_path / "out"
    assert main(["prepare-data", "--eval-hub", "--out", str(out)]) == 0
    rows = [json.loads(x) for x in (out / "eval" / "olympiadbench.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [e["id"] for e in _expected("olympiadbench")]
    assert rows[0]["prompt"].startswith("Please solve the following math problem: Xenia and Sergey")
    report = json.loads((out / "prepare_report.json").read_text())
    assert report["eval"]["amc24"]["from"] == "rawsh/2024_AMC12" and report["eval_missing"] == []
    assert main(["prepare-data", "--eval-hub", "--eval-sets", "math500,gsm8k", "--out", str(out)]) == 2
    assert "--eval-hub has no source for ['gsm8k']" in capsys.readouterr().err
    assert main(["prepare-data", "--eval-hub", "--eval-dir", str(tmp_path), "--out", str(out)]) == 2


def test_control_characters_from_unescaped_latex_are_repaired_and_real_tabs_kept():
    bench = hub.BENCHMARKS["aime25"]
    rows = hub.normalise(bench, [{"problem": "In \triangle ABC, \x0crac{1}{2}", "answer": "7"},
                                 {"problem": "have\tequal perimeters; {\treturn x;}", "answer": "007"}])
    assert rows[0]["problem"] == "In \\triangle ABC, \\frac{1}{2}" and rows[0]["problem_text_repaired"]
    assert rows[1]["problem"] == "have\tequal perimeters; {\treturn x;}" and "problem_text_repaired" not in rows[1]
    assert [r["id"] for r in rows] == ["aime25/0000", "aime25/0001"] and rows[1]["answer"] == "7"
