"""DeepScaleR-style problems -> the project's training format ``{id, prompt, answer, source}``.

``prompt`` is the final text given to the tokenizer: the prompt template applied to the problem and, when a
tokenizer is given, its chat template (a single user turn with the generation prompt, as verl does for
M2PO). Encode it with :func:`encode_prompt` (no extra special tokens). ``problem`` is kept alongside, so a
run's ``data.prompt_template`` can re-render the prompt (data/rows.py); rows prepared with a chat
template carry ``chat_template: true`` so that the loop never wraps them twice.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

# The paper's / released code's template (M2PO examples/data_preprocess), verbatim up to the final space.
M2PO_TEMPLATE = (
    "Please solve the following math problem: {problem}. The assistant first thinks about the reasoning "
    "process step by step and then provides the user with the answer. Return the final answer in \\boxed{{}} "
    "tags, for example \\boxed{{1}}. Let's solve this step by step. "
)
TEMPLATES = {"m2po": M2PO_TEMPLATE, "plain": "{problem}"}

# The 8 benchmarks of the paper; avg@k sample counts as in its evaluation (16 for AIME, 4 for the others).
EVAL_SETS = {
    "math500": 4, "aime24": 16, "aime25": 16, "amc23": 4, "amc24": 4,
    "gaokao2023en": 4, "minerva_math": 4, "olympiadbench": 4,
}

_PROBLEM_KEYS = ("problem", "question", "prompt")
_ANSWER_KEYS = ("answer", "final_answer", "ground_truth", "solution_answer")


def resolve_template(template: str) -> str:
    """A preset name ("m2po", "plain") or a format string with exactly one ``{problem}`` field."""
    t = TEMPLATES.get(template, template)
    try:
        t.format(problem="x")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"prompt template {template!r} is not a valid format string with a {{problem}} field "
                         f"(escape literal braces as {{{{ }}}}): {e}") from e
    if "{problem}" not in t:
        raise ValueError(f"prompt template {template!r} has no {{problem}} field; presets: {sorted(TEMPLATES)}")
    return t


def render_prompt(problem: str, template: str, tokenizer=None) -> str:
    text = template.format(problem=problem)
    if tokenizer is None:
        return text
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; drop the chat-template option or use an instruct "
                         "tokenizer")
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def chat_prefix(tokenizer) -> str:
    """What the tokenizer's chat template puts before a user turn's content ('' without a template)."""
    if not getattr(tokenizer, "chat_template", None):
        return ""
    sentinel = "\x00M2PO\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": sentinel}], tokenize=False,
                                         add_generation_prompt=True)
    return text.split(sentinel, 1)[0] if sentinel in text else ""


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of a prepared ``prompt`` (its special tokens are already in the text)."""
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def _pick(rec: dict, key: str | None, candidates: tuple[str, ...]):
    if key is not None:
        return rec.get(key)
    for k in candidates:
        if rec.get(k) is not None:
            return rec[k]
    return None


def _answer_text(v) -> str | None:
    if isinstance(v, list):  # e.g. OlympiadBench final_answer lists: M2PO uses the first one
        v = v[0] if v else None
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, (int, float)):
        v = str(v)
    if not isinstance(v, str):
        return None
    v = v.strip()
    if len(v) >= 2 and v[0] == "$" and v[-1] == "$":
        v = v.strip("$").strip()
    return v or None


@dataclass
class PrepareReport:
    source: str
    rows_in: int = 0
    rows_out: int = 0
    duplicates: int = 0
    malformed: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"source": self.source, "rows_in": self.rows_in, "rows_out": self.rows_out,
                "duplicates": self.duplicates, "malformed": len(self.malformed),
                "malformed_rows": self.malformed[:100]}


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def prepare_rows(records: list[tuple[int, dict]], source: str, *, template: str = "m2po", tokenizer=None,
                 seed: int | None = 42, dedup: bool = True, problem_key: str | None = None,
                 answer_key: str | None = None, keep_ids: bool = True,
                 report: PrepareReport | None = None) -> tuple[list[dict], PrepareReport]:
    """Turn ``(line_number, record)`` pairs into training rows; skip and report malformed ones.

    Rows keep the record's ``id`` when it has one (``keep_ids``), else get ``{source}/{index}`` in input
    order; they are then shuffled with ``seed`` (None keeps input order). Duplicates are by whitespace-
    normalised problem text; the first occurrence wins.
    """
    tmpl = resolve_template(template)
    report = report or PrepareReport(source)
    report.rows_in += len(records)
    seen: set[str] = set()
    rows = []
    for n, rec in records:
        problem = _pick(rec, problem_key, _PROBLEM_KEYS)
        answer = _answer_text(_pick(rec, answer_key, _ANSWER_KEYS))
        if not isinstance(problem, str) or not problem.strip():
            report.malformed.append({"line": n, "reason": f"missing or empty problem ({problem_key or '/'.join(_PROBLEM_KEYS)})"})
            continue
        if answer is None:
            report.malformed.append({"line": n, "reason": f"missing or empty answer ({answer_key or '/'.join(_ANSWER_KEYS)})"})
            continue
        problem = problem.strip()
        key = _norm(problem)
        if dedup and key in seen:
            report.duplicates += 1
            continue
        seen.add(key)
        rid = rec.get("id") if keep_ids and isinstance(rec.get("id"), (str, int)) else None
        row = {"id": str(rid) if rid is not None else f"{source}/{len(rows)}",
               "prompt": render_prompt(problem, tmpl, tokenizer), "answer": answer, "source": source,
               "problem": problem}
        if tokenizer is not None:  # the training loop must not wrap it again (data.apply_chat_template)
            row["chat_template"] = True
        rows.append(row)
    if seed is not None:
        random.Random(seed).shuffle(rows)
    report.rows_out += len(rows)
    return rows, report


def resolve_input(spec: str, split: str = "train", cache_dir: str | None = None) -> list[str]:
    """A local file, or a Hugging Face dataset id (downloaded with huggingface_hub; needs network) whose
    JSON/JSONL/parquet files for ``split`` are returned."""
    from pathlib import Path

    from .records import SUFFIXES

    p = Path(spec)
    if p.exists():
        if p.is_dir():
            files = sorted(str(f) for f in p.rglob("*") if f.name.lower().endswith(SUFFIXES))
            if not files:
                raise FileNotFoundError(f"{p}: directory holds no {', '.join(SUFFIXES)} files")
            return files
        return [str(p)]
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", spec):
        raise FileNotFoundError(f"{spec}: not a file, and not a Hugging Face dataset id (org/name)")
    try:
        from huggingface_hub import snapshot_download

        root = Path(snapshot_download(repo_id=spec, repo_type="dataset", cache_dir=cache_dir,
                                      allow_patterns=[f"*{s}" for s in SUFFIXES]))
    except Exception as e:
        raise RuntimeError(f"could not download Hugging Face dataset {spec!r} ({type(e).__name__}: {e}); "
                           "offline, pass a local path instead") from e
    files = sorted(str(f) for f in root.rglob("*") if f.name.lower().endswith(SUFFIXES))
    in_split = [f for f in files if split in Path(f).relative_to(root).as_posix()]
    if not (in_split or files):
        raise FileNotFoundError(f"dataset {spec!r} has no {', '.join(SUFFIXES)} files")
    return in_split or files


def find_eval_file(eval_dir, name: str):
    """``<eval_dir>/<name>.{jsonl,jsonl.gz,json,parquet}`` or None."""
    from pathlib import Path

    from .records import SUFFIXES

    for suf in SUFFIXES:
        f = Path(eval_dir) / f"{name}{suf}"
        if f.is_file():
            return f
    return None


def shipped_eval_dir():
    """The eval sets whose licences allow shipping them in the package (MATH-500, MIT)."""
    from pathlib import Path

    return Path(__file__).resolve().parents[1] / "assets" / "eval"
