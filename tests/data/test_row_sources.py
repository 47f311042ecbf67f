"""Rows with any fields from every file kind a user brings (issue 47): JSONL (plain and gzip), JSON, parquet, a
`datasets` save_to_disk directory (Dataset, and DatasetDict with its split) and load_dataset on local files (a
.csv, a directory of data files), all real files in tmp_path, read into the same TaskRows."""
import gzip
import json

import pytest

from m2po_megatron.config.schema import DataSection
from m2po_megatron.data.rows import DataError, load_task_rows
from m2po_megatron.demo.tiny_tokenizer import build_tiny_tokenizer

# One schema for every row: Arrow (parquet, datasets) fills a nested key missing in some rows with null, which
# would make those rows differ from the JSONL ones as read.
ROWS = [{"id": f"q{i}", "prompt": f"What is {i}+{i}?", "answer": str(2 * i),
         "tests": [{"input": f"{i} {i}", "output": str(2 * i)}, {"input": "0 0", "output": "0"}],
         "meta": {"level": i % 3, "tags": ["sum", f"t{i}"]}} for i in range(6)]
OTHER = [{**r, "id": f"e{i}", "prompt": f"What is {i}+1?", "answer": str(i + 1)} for i, r in enumerate(ROWS[:3])]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def load(path, tok, **kw):
    return load_task_rows(str(path), DataSection(metadata_key="meta"), tok, **kw)


def write_jsonl(path, rows):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_gzip_json_parquet_and_datasets_dirs_give_the_same_task_rows(tmp_path, tok):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    base = load(write_jsonl(tmp_path / "train.jsonl", ROWS), tok)
    assert [t.id for t in base] == [r["id"] for r in ROWS] and [t.label for t in base] == [r["answer"] for r in ROWS]
    assert [t.row for t in base] == ROWS  # every field as written, nested lists and objects included
    assert base[0].prompt == tok.apply_chat_template([{"role": "user", "content": "What is 0+0?"}], tokenize=False,
                                                     add_generation_prompt=True)
    assert base[0].prompt_ids == tok(base[0].prompt, add_special_tokens=False)["input_ids"]

    (tmp_path / "train.json").write_text(json.dumps({"data": ROWS}))  # an object holding one list
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "train.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                          "test": datasets.Dataset.from_list(OTHER)}).save_to_disk(str(tmp_path / "dd"))
    for path in (write_jsonl(tmp_path / "train.jsonl.gz", ROWS), tmp_path / "train.json",
                 tmp_path / "train.parquet", tmp_path / "ds", tmp_path / "dd"):
        assert load(path, tok, split="train") == base, path
    test = load(tmp_path / "dd", tok, split="test", key="data.eval_paths[0]")
    assert [t.row for t in test] == OTHER and [t.id for t in test] == ["e0", "e1", "e2"]
    with pytest.raises(DataError, match=r"data.eval_paths\[0\]: .*dd: a DatasetDict with splits \['train', "
                                          r"'test'\] and no split 'validation'; set data.eval_split"):
        load(tmp_path / "dd", tok, split="validation", key="data.eval_paths[0]")


def test_load_dataset_on_a_local_csv_and_a_directory_of_data_files(tmp_path, tok):
    flat = [{k: r[k] for k in ("id", "prompt", "answer")} for r in ROWS]
    want = load(write_jsonl(tmp_path / "flat.jsonl", flat), tok)
    lines = ["id,prompt,answer"] + [f'{r["id"]},"{r["prompt"]}",{r["answer"]}' for r in flat]
    (tmp_path / "flat.csv").write_text("\n".join(lines) + "\n")
    got = load(tmp_path / "flat.csv", tok)
    # the csv builder types the answer column as integers; the label is its text all the same
    assert [(t.id, t.prompt_ids, t.prompt, t.label) for t in got] == [(t.id, t.prompt_ids, t.prompt, t.label)
                                                                      for t in want]
    assert got[1].row == {"id": "q1", "prompt": "What is 1+1?", "answer": 2}
    (tmp_path / "flat.tsv").write_text("\n".join(line.replace(",", "\t") for line in lines) + "\n")
    assert [t.label for t in load(tmp_path / "flat.tsv", tok)] == [t.label for t in want]

    d = tmp_path / "files"  # split names from the file names, as datasets infers them
    d.mkdir()
    (d / "train.csv").write_text("\n".join(lines[:4]) + "\n")
    (d / "test.csv").write_text("\n".join(lines[:1] + lines[4:]) + "\n")
    assert [t.id for t in load(d, tok, split="train")] == ["q0", "q1", "q2"]
    assert [t.id for t in load(d, tok, split="test")] == ["q3", "q4", "q5"]
    single = tmp_path / "single"  # one file: its only split, whatever the recipe's split is called
    single.mkdir()
    (single / "rows.csv").write_text("\n".join(lines) + "\n")
    assert len(load(single, tok, split="test")) == 6


def test_unreadable_paths_name_the_option_and_the_path(tmp_path, tok):
    cases = {
        tmp_path / "missing.jsonl": "no such file or directory",
        tmp_path / "rows.xlsx": "unknown data format",
        tmp_path / "bad.parquet": "cannot read it as parquet",
        tmp_path / "bin.jsonl": "cannot read it as UTF-8 JSONL",
        tmp_path / "bad.json": "not valid JSON at line 1",
        tmp_path / "two.json": "exactly one list",
        tmp_path / "empty.jsonl": "no rows",
        tmp_path / "emptydir": "datasets.load_dataset cannot read it",
    }
    (tmp_path / "rows.xlsx").write_text("x")
    (tmp_path / "bad.parquet").write_text("not parquet")
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    (tmp_path / "bad.json").write_text("[{")
    (tmp_path / "two.json").write_text('{"a": [], "b": []}')
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "emptydir").mkdir()
    for path, needle in cases.items():
        with pytest.raises(DataError) as e:
            load(path, tok, key="data.eval_paths[1]")
        msg = str(e.value)
        assert msg.startswith("data.eval_paths[1]: ") and str(path) in msg and needle in msg, msg
    (tmp_path / "broken.jsonl").write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer"\n')
    with pytest.raises(DataError, match=r"broken.jsonl:3: not valid JSON"):  # the line, blank lines counted
        load(tmp_path / "broken.jsonl", tok)
