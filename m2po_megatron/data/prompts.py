"""The training prompts as the generators read them: the seeded endless stream over the run's TaskRows (its
position is run state; the rows themselves are read again from the data on resume), and prompt text -> token
ids with the length check."""
from __future__ import annotations

import random
from typing import TYPE_CHECKING

from m2po_megatron.data.rows import too_long_message

if TYPE_CHECKING:
    from m2po_megatron.data.rows import TaskRow


class PromptStream:
    """Endless, seeded pass over the training rows (one shuffle per epoch)."""

    def __init__(self, rows: list["TaskRow"], seed: int):
        if not rows:
            raise ValueError("the training set is empty; check data.train_path")
        self.rows, self.seed = rows, seed
        self.epoch, self.pos = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def next(self) -> "TaskRow":
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


class Tokenize:
    """Final prompt text (the chat template already applied) -> token ids, with data.max_prompt_len's check."""

    def __init__(self, tokenizer, max_prompt_len: int):
        self.tok, self.max_len = tokenizer, max_prompt_len

    def __call__(self, prompt: str) -> list[int]:
        ids = self.tok(prompt, add_special_tokens=False)["input_ids"]  # its special tokens are in the text
        if len(ids) > self.max_len:
            raise ValueError(too_long_message(len(ids), self.max_len, prompt))
        return list(ids)
