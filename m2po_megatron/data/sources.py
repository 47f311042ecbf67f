"""A data path read into numbered rows, every field as the file holds it: JSONL (.jsonl, .jsonl.gz), JSON
(.json, .json.gz: a list of rows, or an object holding one list), parquet, and through the `datasets` library a
directory written by save_to_disk (a Dataset, or a DatasetDict and a split), local .csv/.tsv/.arrow files and
directories of data files (load_dataset). Only paths on this machine: nothing is downloaded from a hub."""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

# load_dataset's builder for a single local file of these types (.tsv: csv with a tab delimiter)
DATASETS_BUILDERS = {".csv": "csv", ".tsv": "csv", ".arrow": "arrow"}
KINDS = ("JSONL (.jsonl, .jsonl.gz), JSON (.json, .json.gz), .parquet, .csv, .tsv, .arrow, a directory written by "
         "datasets' save_to_disk, or a directory of such data files")


class SourceError(ValueError):
    """A data path that cannot be read as rows; the message starts with the path."""


@dataclass
class Source:
    path: str  # as the recipe names it
    rows: list[tuple[int, Any]]  # (number, row): 1-based line of a JSONL file, else 1-based row; rows as read
    unit: str  # "line" (JSONL) | "row"

    def at(self, n: int) -> str:
        """Where row n is, for messages: `file:line` (the form editors jump to) or `path: row n`."""
        return f"{self.path}:{n}" if self.unit == "line" else f"{self.path}: row {n}"


def read_source(path: str, split: Optional[str] = None, split_key: str = "data.train_split") -> Source:
    """The rows of `path`. `split` picks a DatasetDict's split (`split_key` is the option that names it, for the
    message when it is absent); a single file or Dataset is its own split."""
    p = Path(os.path.expanduser(str(path)))
    name = p.name.lower()
    if not p.exists():
        raise SourceError(f"{path}: no such file or directory (expected {KINDS})")
    if p.is_dir():
        return Source(str(path), _numbered(_dataset_dir(p, split, split_key)), "row")
    if name.endswith((".jsonl", ".jsonl.gz")):
        return Source(str(path), _jsonl(p), "line")
    if name.endswith((".json", ".json.gz")):
        return Source(str(path), _numbered(json_rows(p)), "row")
    if name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return Source(str(path), _numbered(pq.read_table(p).to_pylist()), "row")
        except (OSError, pa.ArrowException) as e:
            raise SourceError(f"{path}: cannot read it as parquet ({e})") from None
    suffix = "." + name.rsplit(".", 1)[-1] if "." in name else ""
    if suffix in DATASETS_BUILDERS:
        extra = {"delimiter": "\t"} if suffix == ".tsv" else {}
        return Source(str(path), _numbered(_load_dataset(str(p), split, split_key, DATASETS_BUILDERS[suffix],
                                                         data_files=str(p), **extra)), "row")
    raise SourceError(f"{path}: unknown data format; use {KINDS}")


def _numbered(rows: list) -> list[tuple[int, Any]]:
    return list(enumerate(rows, 1))


def _open_text(p: Path):
    return gzip.open(p, "rt", encoding="utf-8") if p.name.lower().endswith(".gz") else open(p, encoding="utf-8")


def _jsonl(p: Path) -> list[tuple[int, Any]]:
    try:
        with _open_text(p) as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise SourceError(f"{p}: cannot read it as UTF-8 JSONL ({e})") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue  # blank lines (a trailing one above all) are no rows
        try:
            out.append((n, json.loads(line)))
        except json.JSONDecodeError as e:
            raise SourceError(f"{p}:{n}: not valid JSON ({e.msg}, column {e.colno}); each line must be one JSON "
                              f"object") from None
    return out


def json_rows(p: Path) -> list:
    """The list of rows a .json file holds: a JSON list, or an object holding exactly one list."""
    try:
        with _open_text(p) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise SourceError(f"{p}: cannot read it as UTF-8 JSON ({e})") from None
    except json.JSONDecodeError as e:
        raise SourceError(f"{p}: not valid JSON at line {e.lineno} ({e.msg}); for one object per line name the "
                          f"file .jsonl") from None
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise SourceError(f"{p}: a JSON object must hold exactly one list of rows (it holds {len(lists)})")
        data = lists[0]
    if not isinstance(data, list):
        raise SourceError(f"{p}: expected a JSON list of rows, got {type(data).__name__}")
    return data


@contextlib.contextmanager
def _quiet():
    """datasets' progress bars off while it reads (they would fill a run's log), as they were afterwards."""
    import datasets

    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was:
            datasets.enable_progress_bars()


def _dataset_dir(p: Path, split: Optional[str], split_key: str) -> list:
    if (p / "dataset_dict.json").is_file() or (p / "state.json").is_file():  # what save_to_disk writes
        import datasets

        try:
            with _quiet():
                ds = datasets.load_from_disk(str(p))
        except Exception as e:  # noqa: BLE001 - datasets raises many types on a damaged directory; name it
            raise SourceError(f"{p}: datasets.load_from_disk cannot read it ({_first_line(e)})") from None
        return _pick_split(ds, p, split, split_key, strict=True).to_list()
    return _load_dataset(str(p), split, split_key, None)


def _load_dataset(path: str, split: Optional[str], split_key: str, builder: Optional[str], **kw) -> list:
    """load_dataset on local files, through a throw-away cache: the rows are read once into memory here, and a
    run leaves nothing in ~/.cache (nor reads a stale copy of a file edited since)."""
    import datasets

    with tempfile.TemporaryDirectory(prefix="m2po-datasets-") as cache, _quiet():
        try:
            ds = datasets.load_dataset(builder or path, cache_dir=cache, **kw)
        except Exception as e:  # noqa: BLE001 - parse errors of any builder, no data files, ...: name the path
            raise SourceError(f"{path}: datasets.load_dataset cannot read it ({_first_line(e)})") from None
        # files whose split the file names do not give are one "train" split: that is the path's only data
        return _pick_split(ds, path, split, split_key, strict=False).to_list()


def _pick_split(ds, path, split: Optional[str], split_key: str, strict: bool):
    import datasets

    if not isinstance(ds, (datasets.DatasetDict, dict)):
        return ds
    names = list(ds)
    if split is not None and split in ds:
        return ds[split]
    if len(names) == 1 and (not strict or split is None):
        return ds[names[0]]
    raise SourceError(f"{path}: a DatasetDict with splits {names} and no split {split!r}; set {split_key} to one of "
                      f"them")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
