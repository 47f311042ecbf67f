"""A run's data rows with whatever fields they have. Each row of a data file (data/sources.py reads them) becomes
a TaskRow: the exact prompt tokens the model sees, beside the user's row untouched, so that every field (chat
messages, tool schemas, test cases, metadata) reaches the rollout function and the reward.

The prompt (data.input_key) is raw text, chat messages (rendered with the tokenizer's chat template, with the
row's tool schemas when data.tools_key is set) or token ids (used as given); data.prompt_format says which, or
"auto" tells them apart by type. Every row is checked before anything starts: a missing or mistyped column is a
DataError naming the option, the file, the line or row and the column (run.inputs.load_data raises it as a
ConfigError: `m2po train` exits 2)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from m2po_megatron.data.prepare import chat_prefix, resolve_template
from m2po_megatron.data.sources import SourceError, read_source

PROMPT_FORMATS = ("auto", "text", "messages", "ids")
ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")
SHOWN_ERRORS = 5  # rows named in one error; the rest are counted
_TOKENIZE_BATCH = 1024


class DataError(ValueError):
    """A data file or row a run cannot use; the message names the option, the file, the line or row and the
    column, and the fix."""


@dataclass
class RowOptions:
    """The data.* options that shape a row, with config.schema.DataSection's names and defaults (this layer does
    not import the config; tests/data/test_rows.py checks that the defaults agree). load_task_rows takes this,
    a DataSection or a recipe's `data`."""
    input_key: str = "prompt"
    label_key: Optional[str] = "answer"
    tools_key: Optional[str] = None
    metadata_key: Optional[str] = None
    id_key: str = "id"
    prompt_format: str = "auto"
    prompt_template: Optional[str] = None
    apply_chat_template: bool = True
    max_prompt_len: int = 1534


@dataclass
class TaskRow:
    id: str  # row[data.id_key] as a string, else "<file stem>/<n>" (n: 1-based row number)
    prompt_ids: list[int]  # the exact tokens the model sees (templates applied, or the row's ids as given)
    prompt: str  # the prompt text the model sees (rendered; for ids: tokenizer.decode(ids))
    row: dict  # the user's row, every field as read, untouched
    label: Optional[str]  # str(row[data.label_key]) when present and non-empty, else None


def too_long_message(n_tokens: int, max_len: int, prompt: str) -> str:
    return (f"a prompt has {n_tokens} tokens > data.max_prompt_len = {max_len}; filter the data or raise "
            f"data.max_prompt_len: {prompt[:80]!r}")


def task_state(task: TaskRow) -> dict:
    """A TaskRow as a checkpoint keeps it (JSON when the row is): a prompt in flight at a checkpoint is
    regenerated on resume with exactly these tokens (as_task reads it back)."""
    return {"task_row": {"id": task.id, "prompt_ids": list(task.prompt_ids), "prompt": task.prompt, "row": task.row,
                         "label": task.label}}


def as_task(obj, tokenize=None) -> TaskRow:
    """A TaskRow from a TaskRow, its task_state, or a row a checkpoint from before TaskRows kept (its `prompt`
    the final text, tokenized with `tokenize`, its `answer` the label)."""
    if isinstance(obj, TaskRow):
        return obj
    if isinstance(obj, dict) and isinstance(obj.get("task_row"), dict):
        return TaskRow(**obj["task_row"])
    if isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and tokenize is not None:
        answer = obj.get("answer")
        return TaskRow(id=str(obj.get("id")), prompt_ids=tokenize(obj["prompt"]), prompt=obj["prompt"], row=obj,
                       label=str(answer) if answer is not None and str(answer).strip() else None)
    raise TypeError(f"not a TaskRow nor a saved one: {type(obj).__name__} {str(obj)[:80]}")


class RowError(ValueError):
    """One row's problem, in its column; load_task_rows adds the file and the line or row."""

    def __init__(self, column: Optional[str], option: Optional[str], message: str):
        where = "" if column is None else f"column {column!r}" + (f" ({option})" if option else "") + ": "
        super().__init__(where + message)


def load_task_rows(path: str, data_cfg, tokenizer, *, split: Optional[str] = None, require_label: bool = True,
                   key: str = "data.train_path") -> list[TaskRow]:
    """The rows of `path` (data/sources.py: JSONL, JSON, parquet, `datasets`), checked and rendered as
    `data_cfg` (RowOptions, a DataSection or the recipe's `data`) says. `split`: a DatasetDict's split.
    `require_label`: the reward needs data.label_key in every row (math_verify does). `key`: the option naming
    `path`, for messages. Without a tokenizer (`m2po eval` reads its sets before it loads one) text prompts are
    checked and left untokenized (prompt_ids empty; evaluate() encodes them). Any problem is a DataError."""
    opts = _Options(data_cfg)
    opts.check(require_label)
    split_key = "data.train_split" if key == "data.train_path" else "data.eval_split"
    try:
        src = read_source(path, split, split_key)
    except SourceError as e:
        raise DataError(f"{key}: {e}") from None
    if not src.rows:
        raise DataError(f"{key}: {path}: no rows; a data file needs at least one")
    p = Path(str(path))
    build = _Builder(opts, tokenizer, require_label, p.name.split(".")[0] or p.name)
    tasks, errors = [], []
    for pos, (n, row) in enumerate(src.rows, 1):
        try:
            tasks.append((n, build.task(pos, row)))
        except RowError as e:
            errors.append((n, str(e)))
    if tokenizer is not None and not errors:
        errors += build.tokenize(tasks)
    if errors:
        errors.sort(key=lambda e: e[0])
        lines = [f"{src.at(n)}: {msg}" for n, msg in errors[:SHOWN_ERRORS]]
        if len(errors) == 1:
            raise DataError(f"{key}: {lines[0]}")
        more = f"\n  (and {len(errors) - SHOWN_ERRORS} more)" if len(errors) > SHOWN_ERRORS else ""
        raise DataError(f"{key}: {len(errors)} rows of {path} are invalid:\n  - " + "\n  - ".join(lines) + more)
    return [t for _, t in tasks]


class _Options:
    """The options of `d` that shape a row (RowOptions' defaults where one is absent), checked once."""

    def __init__(self, d):
        base = RowOptions()
        for name in RowOptions.__dataclass_fields__:
            setattr(self, name, getattr(d, name) if hasattr(d, name) else getattr(base, name))

    def check(self, require_label: bool) -> None:
        if self.prompt_format not in PROMPT_FORMATS:
            raise DataError(f"data.prompt_format = {self.prompt_format!r} is not one of {', '.join(PROMPT_FORMATS)}")
        if self.prompt_template and self.prompt_format in ("messages", "ids"):
            raise DataError(f"data.prompt_template renders a text prompt from each row's `problem`; it does not "
                            f"apply to data.prompt_format = {self.prompt_format}: set data.prompt_template=null "
                            f"or data.prompt_format=text")
        if require_label and not self.label_key:
            raise DataError("data.label_key is null but the reward needs a label (a reference answer) in every "
                            "row; set data.label_key to the column that holds it")
        for name in ("input_key", "id_key"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise DataError(f"data.{name} must name a column, got {getattr(self, name)!r}")


class _Builder:
    """One file's rows -> TaskRows: checks, templates, then (`tokenize`) the tokens and the length check."""

    def __init__(self, o: _Options, tokenizer, require_label: bool, stem: str):
        self.o, self.tok, self.require_label, self.stem = o, tokenizer, require_label, stem
        self.template = resolve_template(o.prompt_template) if o.prompt_template else None
        self.has_chat = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
        self.wrap = bool(o.apply_chat_template) and self.has_chat
        try:
            self.prefix = chat_prefix(tokenizer) if self.wrap else ""
        except Exception:  # noqa: BLE001 - a template that fails on one user turn fails each row's render, named
            self.prefix = ""
        # One int object per token id, shared by every row: a training set's prompt ids cost a list slot per
        # token (8 bytes) instead of a new int each (+28 bytes).
        self.ints = list(range(len(tokenizer))) if tokenizer is not None else []

    # -- one row ---------------------------------------------------------------------------------------
    def task(self, pos: int, row: Any) -> TaskRow:
        if not isinstance(row, dict):
            raise RowError(None, None, f"not an object but {_kind(row)}; a row is one JSON object of named "
                                       f"columns")
        o = self.o
        kind, value = self._prompt_value(row)
        label = self._label(row)
        tools = self._json_column(row, o.tools_key, "data.tools_key", list, "a list of tool schemas (objects)")
        bad = [t for t in tools or [] if not isinstance(t, dict)]
        if bad:
            raise RowError(o.tools_key, "data.tools_key", f"must be a list of tool schemas (objects), got a list "
                                                          f"holding {_kind(bad[0])}")
        self._json_column(row, o.metadata_key, "data.metadata_key", dict, "a JSON object")
        ids: Optional[list[int]] = None
        if kind == "ids":
            ids = self._ids(value)
            text = self.tok.decode(ids)
        elif kind == "messages":
            text = self._render(_messages(value, o.input_key), tools, o.input_key, "data.input_key")
        else:
            text = value
            if self.wrap:
                if self.template is None and (row.get("chat_template") is True
                                              or (self.prefix.strip() and text.startswith(self.prefix))):
                    raise RowError(o.input_key, "data.input_key",
                                   "already carries the chat template (prepared with --chat-template) and "
                                   "data.apply_chat_template = true would apply it twice; set "
                                   "data.apply_chat_template=false, or prepare the data without --chat-template")
                text = self._render([{"role": "user", "content": text}], tools, o.input_key, "data.input_key")
        return TaskRow(id=self._id(row, pos), prompt_ids=ids if ids is not None else [], prompt=text, row=row,
                       label=label)

    def _id(self, row: dict, pos: int) -> str:
        v = column(row, self.o.id_key)
        if v is None or v == "":
            return f"{self.stem}/{pos}"
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise RowError(self.o.id_key, "data.id_key", f"must be a string or an integer, got {_kind(v)}")
        return str(v)

    def _label(self, row: dict) -> Optional[str]:
        k = self.o.label_key
        v = column(row, k) if k else None
        if isinstance(v, float) and math.isnan(v):
            v = None  # a missing cell of a numeric CSV/parquet column
        if isinstance(v, (str, int, float)) and not isinstance(v, bool):
            label = str(v)
            if label.strip():
                return label
        elif v is not None and self.require_label:
            raise RowError(k, "data.label_key", f"must be a string or a number (the reference answer), got "
                                                f"{_kind(v)}")
        if self.require_label:
            raise RowError(k, "data.label_key", f"missing or empty; the reward needs a reference answer in every "
                                                f"row: set data.label_key to the column that holds it "
                                                f"({_columns(row)})")
        return None

    def _json_column(self, row: dict, key: Optional[str], option: str, want: type, what: str):
        """tools / metadata: absent or null is allowed; a string is parsed as JSON (parquet and CSV files keep
        nested values of varying shape as JSON text)."""
        v = column(row, key) if key else None
        if v is None:
            return None
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise RowError(key, option, f"must be {what}; it is a string that is not JSON ({e.msg})") from None
        if not isinstance(v, want):
            raise RowError(key, option, f"must be {what}, got {_kind(v)}")
        return v

    def _prompt_value(self, row: dict) -> tuple[str, Any]:
        o = self.o
        if self.template is not None:
            problem = row.get("problem")
            if not isinstance(problem, str) or not problem.strip():
                raise RowError("problem", None, "missing or empty; data.prompt_template is rendered from it: "
                                                "re-run `m2po prepare-data` (it keeps the problem), or set "
                                                "data.prompt_template=null to use the prompt column")
            return "text", self.template.format(problem=problem)
        v = column(row, o.input_key)
        if v is None:
            raise RowError(o.input_key, "data.input_key", f"missing; set data.input_key to the column that holds "
                                                          f"the prompt ({_columns(row)})")
        fmt = o.prompt_format
        if fmt in ("messages", "ids") and isinstance(v, str):
            try:  # a CSV or parquet column holding the list as JSON text
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise RowError(o.input_key, "data.input_key", f"data.prompt_format = {fmt} but the value is a "
                                                              f"string that is not JSON ({e.msg})") from None
        if fmt == "auto":
            if isinstance(v, str):
                fmt = "text"
            elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
                fmt = "messages"
            elif isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                fmt = "ids"
            else:
                raise RowError(o.input_key, "data.input_key",
                               f"must be text, chat messages [{{role, content}}, ...] or token ids [int, ...], got "
                               f"{'an empty list' if v == [] else _kind(v)}")
        if fmt == "text" and (not isinstance(v, str) or not v.strip()):
            raise RowError(o.input_key, "data.input_key", f"must be non-empty text, got "
                                                          f"{_kind(v) if not isinstance(v, str) else 'empty text'}")
        return fmt, v

    def _ids(self, v: Any) -> list[int]:
        col, opt = self.o.input_key, "data.input_key"
        if self.tok is None:
            raise RowError(col, opt, "token ids need the model's tokenizer to be checked")
        if not isinstance(v, list) or not v:
            raise RowError(col, opt, f"token ids must be a non-empty list of integers, got "
                                     f"{'an empty list' if v == [] else _kind(v)}")
        vocab = len(self.ints)
        for j, x in enumerate(v):
            if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < vocab:
                raise RowError(col, opt, f"token {j} is {x!r}: token ids must be integers in [0, {vocab}) (the "
                                         f"tokenizer's vocabulary)")
        return [self.ints[x] for x in v]

    def _render(self, messages: list[dict], tools: Optional[list], col: str, opt: str) -> str:
        if self.tok is None:
            raise RowError(col, opt, "chat messages need the model's tokenizer to be rendered")
        if not self.has_chat:
            raise RowError(col, opt, "chat messages need a tokenizer with a chat template; this one has none "
                                     "(give model.tokenizer an instruct tokenizer, or use text prompts)")
        try:
            return self.tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template may raise anything (jinja's raise_exception included)
            raise RowError(col, opt, f"the tokenizer's chat template fails on these messages ({_first_line(e)})") \
                from None

    # -- all rows: tokens and lengths ------------------------------------------------------------------
    def tokenize(self, tasks: list[tuple[int, TaskRow]]) -> list[tuple[int, str]]:
        """Fill prompt_ids of the rendered prompts (in batches: the fast tokenizer spreads a batch over its
        threads) and check every prompt's length; the errors as (number, message)."""
        col, opt = self.o.input_key, "data.input_key"
        todo = [(n, t) for n, t in tasks if not t.prompt_ids]
        errors = []
        for b in range(0, len(todo), _TOKENIZE_BATCH):
            chunk = todo[b:b + _TOKENIZE_BATCH]
            try:
                encoded = self.tok([t.prompt for _, t in chunk], add_special_tokens=False)["input_ids"]
            except Exception:  # noqa: BLE001 - a tokenizer may fail in many ways on odd text: find the row
                encoded = []
                for n, t in chunk:
                    try:
                        encoded.append(self.tok(t.prompt, add_special_tokens=False)["input_ids"])
                    except Exception as e:  # noqa: BLE001
                        errors.append((n, str(RowError(col, opt, f"the tokenizer fails on it ({_first_line(e)})"))))
                        encoded.append([])
            ints = self.ints
            for (n, t), ids in zip(chunk, encoded):
                t.prompt_ids = [ints[i] for i in ids]  # the tokenizer's own ids: in range by construction
        for n, t in tasks:
            if len(t.prompt_ids) > self.o.max_prompt_len:
                errors.append((n, str(RowError(col, opt, too_long_message(len(t.prompt_ids), self.o.max_prompt_len,
                                                                           t.prompt)))))
        return errors


def column(row: dict, key: str) -> Any:
    """row[key]; a dotted key that is not a column itself reads a nested field (verl's rows keep the reference
    answer at reward_model.ground_truth); None when absent."""
    if key in row or "." not in key:
        return row.get(key)
    v: Any = row
    for part in key.split("."):
        if not isinstance(v, dict) or part not in v:
            return None
        v = v[part]
    return v


def _messages(v: Any, col: str) -> list[dict]:
    opt = "data.input_key"
    if not isinstance(v, list) or not v:
        raise RowError(col, opt, f"chat messages must be a non-empty list of {{role, content}} objects, got "
                                 f"{'an empty list' if v == [] else _kind(v)}")
    for j, m in enumerate(v):
        if not isinstance(m, dict):
            raise RowError(col, opt, f"message {j} is {_kind(m)}, not a {{role, content}} object")
        role = m.get("role")
        if role not in ROLES:
            hint = " (ShareGPT's from/value? rename them role/content)" if "from" in m else ""
            raise RowError(col, opt, f"message {j} has role {role!r}; a role is one of {', '.join(ROLES)}{hint}")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RowError(col, opt, f"message {j} has content of type {_kind(content)}; content is text, a list "
                                     f"of parts, or null")
    return v


_KINDS = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
          float: "a number", type(None): "null"}


def _kind(v: Any) -> str:
    return _KINDS.get(type(v), type(v).__name__)


def _columns(row: dict) -> str:
    names = list(row)
    shown = ", ".join(repr(k) for k in names[:12]) + (", ..." if len(names) > 12 else "")
    return f"the row's columns: {shown}" if names else "the row has no columns"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
