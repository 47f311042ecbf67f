"""Read problem records from JSON, JSONL (optionally .gz) or parquet, counting malformed rows by line/row
number instead of failing, and write the training format as JSONL or parquet."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")


@dataclass
class ReadReport:
    path: str
    rows: int = 0
    malformed: list[dict] = field(default_factory=list)  # {"line": n, "reason": "..."}

    def add(self, line: int, reason: str) -> None:
        self.malformed.append({"line": line, "reason": reason})


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def read_records(path: str | Path) -> tuple[list[tuple[int, dict]], ReadReport]:
    """``[(line_or_row_number, record)]`` (1-based) and a report of rows that could not be read.

    JSON may be a list of objects or an object holding one list (e.g. ``{"data": [...]}``); parquet row
    numbers are 1-based row indices.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no such file (expected one of {', '.join(SUFFIXES)})")
    name = p.name.lower()
    report = ReadReport(str(p))
    out: list[tuple[int, dict]] = []
    if name.endswith((".jsonl", ".jsonl.gz")):
        with _open_text(p) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    report.add(n, f"invalid JSON ({e.msg})")
                    continue
                if not isinstance(rec, dict):
                    report.add(n, f"not a JSON object ({type(rec).__name__})")
                    continue
                out.append((n, rec))
    elif name.endswith((".json", ".json.gz")):
        from .sources import json_rows

        data = json_rows(p)  # a SourceError (a ValueError) names the file and what is wrong
        for n, rec in enumerate(data, 1):
            if isinstance(rec, dict):
                out.append((n, rec))
            else:
                report.add(n, f"not a JSON object ({type(rec).__name__})")
    elif name.endswith(".parquet"):
        import pyarrow.parquet as pq

        for n, rec in enumerate(pq.read_table(p).to_pylist(), 1):
            out.append((n, rec))
    else:
        raise ValueError(f"{p}: unknown format; use one of {', '.join(SUFFIXES)}")
    report.rows = len(out) + len(report.malformed)
    return out, report


def write_jsonl(rows: list[dict], path: str | Path) -> str:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with (gzip.open(p, "wt", encoding="utf-8") if p.suffix == ".gz" else open(p, "w", encoding="utf-8")) as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return str(p)


def write_parquet(rows: list[dict], path: str | Path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), p)
    return str(p)


def load_rows(path: str | Path) -> list[dict]:
    """Rows of an already prepared file (JSONL/JSON/parquet); malformed rows are an error here."""
    recs, report = read_records(path)
    if report.malformed:
        m = report.malformed[0]
        raise ValueError(f"{path}: {len(report.malformed)} malformed rows (first: line {m['line']}: "
                         f"{m['reason']}); re-run `m2po prepare-data` on the source")
    return [r for _, r in recs]
