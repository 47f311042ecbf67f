"""The training prompts as the generators read them: rows from the project's format, the seeded endless
stream over them (its position is run state), and prompt text -> token ids with the length check."""
from __future__ import annotations

import gzip
import json
import random
from pathlib import Path


class PromptStream:
    """Endless, seeded pass over the training prompts (one shuffle per epoch)."""

    def __init__(self, rows: list[dict], seed: int):
        if not rows:
            raise ValueError("the training set is empty; check data.train_path")
        self.rows, self.seed = rows, seed
        self.epoch, self.pos = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def next(self) -> dict:
        if self.pos >= len(self._order):
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._shuffle()
        row = self.rows[self._order[self.pos]]
        self.pos += 1
        return row

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, s: dict) -> None:
        self.epoch, self.pos = s["epoch"], s["pos"]
        self._order = self._shuffle()


def load_prompt_rows(path: str) -> list[dict]:
    """Rows of the project's training format (id, prompt, answer[, source]) from JSONL (or .json/.parquet
    as `m2po prepare-data` writes them). Any problem is a ValueError naming the file and the line."""
    p = Path(path)
    if not p.name.endswith((".jsonl", ".jsonl.gz")) and p.name.endswith((".json", ".json.gz", ".parquet")):
        from m2po_megatron.data.records import read_records

        try:
            numbered, report = read_records(p)
        except (OSError, ImportError) as e:
            raise ValueError(f"{path}: cannot read it ({e})") from None
        if report.malformed:
            m = report.malformed[0]
            raise ValueError(f"{path}:{m['line']}: {m['reason']}; run `m2po prepare-data` on the raw file")
    else:
        try:
            text = gzip.open(p, "rt").read() if p.name.endswith(".gz") else p.read_text()
        except (OSError, UnicodeDecodeError, EOFError) as e:
            raise ValueError(f"{path}: cannot read it as UTF-8 JSONL ({e})") from None
        numbered = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                numbered.append((i, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not valid JSON ({e}); run `m2po prepare-data` on the raw file") from None
    rows = []
    for i, row in numbered:
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise ValueError(f"{path}:{i}: a row needs a non-empty string 'prompt' (run `m2po prepare-data`)")
        answer = row.get("answer")
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or not str(answer).strip():
            raise ValueError(f"{path}:{i}: a row needs a non-empty 'answer' (a string or number; run "
                             f"`m2po prepare-data`)")
        row["answer"] = str(answer)
        row.setdefault("id", f"row{i}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows; prepare the data with `m2po prepare-data`")
    return rows


class Tokenize:
    """Final prompt text (run.inputs.load_data applied the prompt and chat templates) -> token ids."""

    def __init__(self, tokenizer, max_prompt_len: int):
        self.tok, self.max_len = tokenizer, max_prompt_len

    def __call__(self, prompt: str) -> list[int]:
        ids = self.tok(prompt, add_special_tokens=False)["input_ids"]  # its special tokens are in the text
        if len(ids) > self.max_len:
            raise ValueError(f"a prompt has {len(ids)} tokens > data.max_prompt_len = {self.max_len}; "
                             f"filter the data or raise data.max_prompt_len: {prompt[:80]!r}")
        return list(ids)
