"""prepare-data on small fixtures (malformed rows included) and on the shared DeepScaleR/eval files."""

import gzip
import json

import pytest

from m2po_megatron.cli import main as cli
from m2po_megatron.data.prepare import (EVAL_SETS, M2PO_TEMPLATE, encode_prompt, prepare_rows, render_prompt,
                                        resolve_template)
from m2po_megatron.data.records import load_rows, read_records, write_parquet

GOOD = [{"problem": f"What is {i}+1?", "answer": str(i + 1)} for i in range(6)]


def _write_jsonl_with_junk(path):
    lines = [json.dumps(GOOD[0]), json.dumps(GOOD[1]),
             "{not json",                                       # line 3: invalid JSON
             json.dumps({"problem": "No answer here"}),           # line 4: missing answer
             "",                                                  # blank lines are ignored, not malformed
             json.dumps({"answer": "3"}),                         # line 6: missing problem
             json.dumps([1, 2]),                                  # line 7: not an object
             json.dumps(GOOD[2]), json.dumps(GOOD[0]),            # line 9: duplicate of line 1
             json.dumps({"problem": "  What is  0+1? ", "answer": "1"}),  # line 10: duplicate up to spaces
             json.dumps({"problem": "Float answer", "answer": 27.0}),
             json.dumps({"problem": "Dollar answer", "answer": "$\\frac{1}{2}$"})]
    path.write_text("\n".join(lines) + "\n")


def test_read_records_reports_line_numbers(tmp_path):
    f = tmp_path / "d.jsonl"
    _write_jsonl_with_junk(f)
    recs, rep = read_records(f)
    assert [m["line"] for m in rep.malformed] == [3, 7]
    assert [n for n, _ in recs] == [1, 2, 4, 6, 8, 9, 10, 11, 12]


def test_prepare_rows_skips_dedups_and_normalises(tmp_path):
    f = tmp_path / "d.jsonl"
    _write_jsonl_with_junk(f)
    recs, _ = read_records(f)
    rows, rep = prepare_rows(recs, "fx", seed=None)
    assert [m["line"] for m in rep.malformed] == [4, 6]
    assert "answer" in rep.malformed[0]["reason"] and "problem" in rep.malformed[1]["reason"]
    assert rep.duplicates == 2
    assert [r["answer"] for r in rows] == ["1", "2", "3", "27", "\\frac{1}{2}"]
    assert set(rows[0]) >= {"id", "prompt", "answer", "source"}
    assert rows[0]["prompt"] == M2PO_TEMPLATE.format(problem="What is 0+1?")
    assert rows[0]["prompt"].startswith("Please solve the following math problem: What is 0+1?. The assistant")
    assert "\\boxed{} tags, for example \\boxed{1}" in rows[0]["prompt"]
    assert len({r["id"] for r in rows}) == len(rows)


def test_shuffle_is_seeded():
    recs = [(i + 1, {"problem": f"p{i}", "answer": "1"}) for i in range(50)]
    a, _ = prepare_rows(recs, "s", seed=42)
    b, _ = prepare_rows(recs, "s", seed=42)
    c, _ = prepare_rows(recs, "s", seed=43)
    assert [r["id"] for r in a] == [r["id"] for r in b] != [r["id"] for r in c]
    assert sorted(r["id"] for r in a) == sorted(r["id"] for r in c)


def test_templates():
    assert resolve_template("plain") == "{problem}"
    assert resolve_template("Q: {problem} A:") == "Q: {problem} A:"
    with pytest.raises(ValueError, match="problem"):
        resolve_template("no field")
    with pytest.raises(ValueError, match="format string"):
        resolve_template("\\boxed{} {problem}")  # unescaped braces


def test_chat_template_with_tiny_tokenizer():
    from m2po_megatron.demo.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    text = render_prompt("Compute 1+2.", "{problem}", tok)
    assert text == "<s><|user|>Compute 1+2.<|assistant|>"
    ids = encode_prompt(tok, text)
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == text


def test_json_list_and_parquet_inputs(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(GOOD[:3] + ["junk"]))
    recs, rep = read_records(tmp_path / "a.json")
    assert len(recs) == 3 and rep.malformed == [{"line": 4, "reason": "not a JSON object (str)"}]
    write_parquet(GOOD[:4], tmp_path / "b.parquet")
    recs, rep = read_records(tmp_path / "b.parquet")
    assert [r["answer"] for _, r in recs] == ["1", "2", "3", "4"] and not rep.malformed
    with pytest.raises(ValueError, match="unknown format"):
        (tmp_path / "c.csv").write_text("x")
        read_records(tmp_path / "c.csv")


def test_cli_end_to_end_with_malformed_rows(tmp_path, capsys):
    src = tmp_path / "train.jsonl"
    _write_jsonl_with_junk(src)
    ev = tmp_path / "evals"
    ev.mkdir()
    with gzip.open(ev / "aime24.jsonl.gz", "wt") as f:
        f.write(json.dumps({"id": "aime24/0", "problem": "Find 2+2.", "answer": "4", "source": "x"}) + "\n")
    out = tmp_path / "out"
    rc = cli(["prepare-data", "--input", str(src), "--out", str(out), "--eval-dir", str(ev), "--parquet",
              "--template", "plain", "--seed", "1"])
    assert rc == 0
    rep = json.loads((out / "prepare_report.json").read_text())
    assert rep["train"]["malformed"] == 4 and rep["train"]["duplicates"] == 2 and rep["train"]["rows_out"] == 5
    assert sorted(m["line"] for m in rep["train"]["malformed_rows"]) == [3, 4, 6, 7]
    assert rep["eval"]["aime24"]["rows_out"] == 1 and "math500" in rep["eval_missing"]
    rows = load_rows(out / "train.jsonl")
    assert len(rows) == 5 and {r["answer"] for r in rows} == {"1", "2", "3", "27", "\\frac{1}{2}"}
    assert load_rows(out / "train.parquet") == rows
    assert load_rows(out / "eval/aime24.jsonl")[0] == {"id": "aime24/0", "prompt": "Find 2+2.", "answer": "4",
                                                        "source": "aime24", "problem": "Find 2+2."}


def test_cli_fails_clearly_on_wrong_fields(tmp_path, capsys):
    src = tmp_path / "t.jsonl"
    src.write_text("\n".join(json.dumps({"q": f"p{i}", "a": "1"}) for i in range(4)) + "\n")
    rc = cli(["prepare-data", "--input", str(src), "--out", str(tmp_path / "o"), "--eval-sets", ""])
    assert rc == 2
    assert "--problem-key" in capsys.readouterr().err
    rc = cli(["prepare-data", "--input", str(src), "--out", str(tmp_path / "o"), "--eval-sets", "",
              "--problem-key", "q", "--answer-key", "a"])
    assert rc == 0 and len(load_rows(tmp_path / "o/train.jsonl")) == 4


def test_shipped_math500(tmp_path):
    rc = cli(["prepare-data", "--out", str(tmp_path), "--eval-sets", "math500"])
    assert rc == 0
    rows = load_rows(tmp_path / "eval/math500.jsonl")
    assert len(rows) == 500 and rows[0]["id"] == "math500/0000"
    assert rows[0]["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"


def test_shared_deepscaler_and_eval_sets(shared_dir, tmp_path):
    data = shared_dir / "data"
    rc = cli(["prepare-data", "--input", str(data / "train/deepscaler_partial_union.jsonl"), "--out",
              str(tmp_path), "--eval-dir", str(data / "eval_normalized")])
    assert rc == 0
    rep = json.loads((tmp_path / "prepare_report.json").read_text())
    assert rep["train"]["rows_in"] == 2770 and rep["train"]["malformed"] == 0
    assert rep["train"]["rows_out"] + rep["train"]["duplicates"] == 2770
    counts = {"math500": 500, "aime24": 30, "aime25": 30, "amc23": 40, "amc24": 45, "gaokao2023en": 385,
              "minerva_math": 272, "olympiadbench": 675}
    assert set(counts) == set(EVAL_SETS)
    for name, n in counts.items():
        rows = load_rows(tmp_path / f"eval/{name}.jsonl")
        assert len(rows) == n, name
        assert all(r["answer"] and r["prompt"].startswith("Please solve the following math problem:") for r in rows)
    train = load_rows(tmp_path / "train.jsonl")
    assert all(set(r) >= {"id", "prompt", "answer", "source"} for r in train)


def test_prepare_data_refuses_bad_inputs(tmp_path, capsys):
    """0 usable rows, a missing --eval-dir, no eval set found, an unwritable --out: exit 2, said clearly."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert cli(["prepare-data", "--input", str(empty), "--out", str(tmp_path / "o1"), "--eval-sets", ""]) == 2
    assert "no usable rows" in capsys.readouterr().err
    assert cli(["prepare-data", "--out", str(tmp_path / "o2"), "--eval-dir", str(tmp_path / "nope")]) == 2
    assert "--eval-dir" in capsys.readouterr().err
    (tmp_path / "evals").mkdir()
    assert cli(["prepare-data", "--out", str(tmp_path / "o3"), "--eval-dir", str(tmp_path / "evals")]) == 2
    assert "none of the eval sets" in capsys.readouterr().err
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert cli(["prepare-data", "--out", str(a_file / "sub"), "--eval-sets", "math500"]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "cannot write" in err and "Traceback" not in err
