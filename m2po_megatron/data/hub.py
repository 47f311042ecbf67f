"""The paper's eight benchmarks fetched from where the released M2PO code loads them, and normalised.

Infini-AI-Lab/M2PO (examples/data_preprocess/test_*.py) loads seven of them from Hugging Face dataset ids and
GaoKao-2023-En from a JSONL file of its own repository; `BENCHMARKS` names each source, split, the columns it
reads and the answer rule. Only AIME/AMC/GaoKao/Minerva/OlympiadBench licences forbid shipping the files
(docs/SOURCES.md), so `m2po prepare-data --eval-hub` fetches them on the user's machine:

- a HF dataset: `huggingface_hub.snapshot_download` (the HF cache; offline, HF_HUB_OFFLINE=1 reads the cache),
  then the snapshot directory through `datasets.load_dataset`'s local-directory builder (data/sources.py),
  which picks files and splits as `load_dataset(<id>)` does;
- a pinned file: downloaded once, checked against its sha256, cached under `$M2PO_CACHE` (default
  `~/.cache/m2po`).

`normalise` turns upstream rows into `{id, problem, answer, source, ...}` rows: ids `<name>/<index:04d>` in
upstream order, answers as strings by the rules below (the same rules produced the workplace's reference
copies, against which tests/data/test_hub.py checks them).
"""
from __future__ import annotations

import hashlib
import os
import re
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


class HubError(RuntimeError):
    """A benchmark could not be fetched or read; the message names the source and what to do."""


@dataclass(frozen=True)
class Benchmark:
    name: str                    # the eval set's file stem and id prefix (recipes read eval/<name>.jsonl)
    source: str                  # HF dataset id, or the URL of a pinned file
    split: Optional[str]         # the split M2PO reads (None: a single file)
    problem_key: str
    answer_key: str
    answer_rule: str             # see ANSWER_RULES
    revision: Optional[str] = None   # a pinned HF commit, where one is known
    sha256: Optional[str] = None     # of a pinned file

    @property
    def is_hf(self) -> bool:
        return not self.source.startswith(("https://", "http://", "file://"))


M2PO_COMMIT = "af54a3e8feffb7a66a8258003aebefa37759cec0"
GAOKAO_URL = f"https://raw.githubusercontent.com/Infini-AI-Lab/M2PO/{M2PO_COMMIT}/raw-data/gaokao-2023en-test.jsonl"

# Columns and splits as the released preprocessing scripts read them (Infini-AI-Lab/M2PO @af54a3e8).
BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("math500", "HuggingFaceH4/MATH-500", "test", "problem", "answer", "text"),
    Benchmark("aime24", "HuggingFaceH4/aime_2024", "train", "problem", "answer", "integer"),
    Benchmark("aime25", "yentinglin/aime_2025", "train", "problem", "answer", "integer"),
    Benchmark("amc23", "math-ai/amc23", "test", "question", "answer", "number"),
    Benchmark("amc24", "rawsh/2024_AMC12", "train", "problem", "answer", "text",
              revision="47b35303156a75cdfc6fcca694db66905d5b2033"),
    Benchmark("gaokao2023en", GAOKAO_URL, None, "question", "answer", "no_dollar",
              sha256="e1503ee5bd33bacb677b707344d64cfa44c9b841428544a14df7a6b643376977"),
    Benchmark("minerva_math", "math-ai/minervamath", "test", "question", "answer", "text"),
    Benchmark("olympiadbench", "math-ai/olympiadbench", "test", "question", "final_answer", "first_no_dollar"),
)}

ANSWER_RULES = {
    "text": "the string as given (stripped)",
    "integer": "an integer answer without leading zeros ('025' -> '25'), as math-verify compares it either way",
    "number": "integral floats as integers ('27.0' -> '27')",
    "no_dollar": "every '$' removed (M2PO's GaoKao rule); an empty answer is recovered from a trailing "
                 "'Answer: X' / 'answers: X' in the question (2 HMMT/SAT rows), flagged",
    "first_no_dollar": "the first element of the list, '$' removed (M2PO's OlympiadBench rule)",
}

# JSON that was written without escaping LaTeX leaves control characters where '\f', '\t', '\b' began a
# command (\frac, \triangle, \binom; AIME25 rows 18, 19, 27): put the backslash back. A form feed or a
# backspace before a letter is never meant; a TAB is only before the LaTeX commands it can have eaten, since
# MATH-500 has real ones in prose and [asy] code ("have\tequal", "{\treturn").
_CONTROL = {"\x0c": "\\f", "\t": "\\t", "\x08": "\\b"}
_CONTROL_RE = re.compile("([\x0c\x08])(?=[A-Za-z])|(\t)(?=(?:riangle|imes|heta|ext\\{|frac|ilde|au\\b))")
_RECOVER_RE = re.compile(r"[Aa]nswers?\s*:\s*([^:]+?)\s*$")  # the text after the last "answer(s):"


def cache_dir() -> Path:
    return Path(os.environ.get("M2PO_CACHE") or Path.home() / ".cache" / "m2po")


def fetch_rows(bench: Benchmark) -> list[dict]:
    """The benchmark's upstream rows, every column as the source holds it."""
    if bench.is_hf:
        return _hf_rows(bench)
    from .sources import SourceError, read_source

    path = _pinned_file(bench)
    try:
        return [row for _, row in read_source(str(path)).rows]
    except SourceError as e:
        raise HubError(f"{bench.name}: {e}") from None


def _hf_rows(bench: Benchmark) -> list[dict]:
    from huggingface_hub import snapshot_download

    from .sources import SourceError, read_source

    try:
        root = snapshot_download(repo_id=bench.source, repo_type="dataset", revision=bench.revision,
                                 allow_patterns=["*.json", "*.jsonl", "*.jsonl.gz", "*.parquet", "*.csv",
                                                 "*.arrow", "README.md"])
    except Exception as e:  # noqa: BLE001 - network, auth, missing cache: each says why; name the set
        raise HubError(f"{bench.name}: could not get Hugging Face dataset {bench.source} ({type(e).__name__}: "
                       f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); online, check the network "
                       f"(or HF_ENDPOINT); offline, fill the HF cache first or give --eval-dir") from None
    try:  # the directory as load_dataset(<id>) would read it: README configs, else split names in file names
        return [row for _, row in read_source(root, bench.split, split_key="the benchmark's split").rows]
    except SourceError as e:
        raise HubError(f"{bench.name} ({bench.source}): {e}") from None


def _pinned_file(bench: Benchmark) -> Path:
    dest = cache_dir() / "downloads" / f"{bench.sha256[:16]}-{bench.source.rsplit('/', 1)[-1]}"
    if dest.is_file() and _sha256(dest.read_bytes()) == bench.sha256:
        return dest
    try:
        with urllib.request.urlopen(bench.source, timeout=60) as r:
            data = r.read()
    except OSError as e:
        raise HubError(f"{bench.name}: could not download {bench.source} ({e}); online, check the network; "
                       f"offline, put the file at {dest} or give --eval-dir") from None
    got = _sha256(data)
    if got != bench.sha256:
        raise HubError(f"{bench.name}: {bench.source} has sha256 {got}, expected {bench.sha256}: not the file the "
                       f"paper evaluated on; give the right file with --eval-dir")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(dest)  # atomic: a concurrent or interrupted download never leaves a half file
    return dest


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def answer_text(value: Any, rule: str) -> Optional[str]:
    """The gold answer as a string by `rule` (ANSWER_RULES); None when there is none."""
    if rule == "first_no_dollar":
        value = value[0] if isinstance(value, (list, tuple)) and len(value) else None
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = str(value).strip()
    if rule in ("no_dollar", "first_no_dollar"):
        text = text.replace("$", "").strip()
    if rule == "integer" and re.fullmatch(r"\d+", text):
        text = str(int(text))
    if rule == "number" and re.fullmatch(r"-?\d+\.0+", text):
        text = text.split(".")[0]
    return text or None


def normalise(bench: Benchmark, rows: list[dict]) -> list[dict]:
    """Upstream rows -> `{id, problem, answer, source, source_index, ...}` in upstream order; a row without a
    problem or an answer keeps `answer` None and is reported as malformed by prepare_rows."""
    out = []
    for i, row in enumerate(rows):
        problem = row.get(bench.problem_key)
        extra: dict = {}
        if isinstance(problem, str) and _CONTROL_RE.search(problem):
            problem = _CONTROL_RE.sub(lambda m: _CONTROL[m.group(0)], problem)
            extra["problem_text_repaired"] = True
        answer = answer_text(row.get(bench.answer_key), bench.answer_rule)
        if answer is None and bench.answer_rule == "no_dollar" and isinstance(problem, str):
            m = _RECOVER_RE.search(problem[-200:])
            if m:
                answer = m.group(1).replace("$", "").strip() or None
                extra["answer_recovered_from_question_text"] = answer is not None
        out.append({"id": f"{bench.name}/{i:04d}", "problem": problem, "answer": answer,
                    "source": bench.source if bench.is_hf else f"Infini-AI-Lab/M2PO@{M2PO_COMMIT[:12]}",
                    "source_index": i, **extra})
    return out


def fetch_benchmark(name: str) -> list[dict]:
    """The normalised rows of benchmark `name` (a key of BENCHMARKS)."""
    if name not in BENCHMARKS:
        raise HubError(f"no hub source for eval set {name!r}; known: {', '.join(BENCHMARKS)}; give it with --eval-dir")
    bench = BENCHMARKS[name]
    return normalise(bench, fetch_rows(bench))
