"""Benchmark batches shaped like the recipes' rollouts, packed by the project's own packer.

The recipes train on rows of train.micro_batch_tokens = 16,384 tokens (recipes/paper/*.yaml). Their rollouts
are math problems (prompts of about 150 tokens after the chat template) with responses of 200 to 4,000
tokens. Here: prompt ~ round(N(150, 40)) clipped to [32, 400]; response log-uniform on [200, 4000] (median
about 900; one draw per sequence, seeded). Sequences are drawn until the packer
(actor.packing.pack_by_token_budget, the one train_step uses) would need one row more than asked, so every
row is nearly full, as in a real mini-batch of hundreds of sequences. `ragged_multiple=16` nudges single
response lengths by a token until no packed row's length is a multiple of 16 (TE's FP8 GEMMs want 16:
the actor must pad such rows itself). No torch in the length draw; torch only to make the TrainBatch.
"""
from __future__ import annotations

import math
import random
from typing import Optional, Sequence

from m2po_megatron.rehearse.stage import PROMPT_MEAN, PROMPT_RANGE, PROMPT_SD, RESPONSE_MIN

RESPONSE_RANGE = (RESPONSE_MIN, 4000)  # m2po rehearse draws up to the recipe's rollout.max_new_tokens instead
RECIPE_ROW = 16384  # recipes/paper/*.yaml train.micro_batch_tokens: lengths scale with row_tokens / this


def draw_lengths(n: int, seed: int = 0, response_range: Sequence[int] = RESPONSE_RANGE,
                 max_len: Optional[int] = None, scale: float = 1.0) -> list[tuple[int, int]]:
    """n (prompt, response) token counts drawn as described above, every length times `scale` (the smoke
    mode's toy rows); prompt + response <= max_len."""
    rng = random.Random(seed)
    lo, hi = (max(1, round(x * scale)) for x in response_range)
    plo, phi = (max(1, round(x * scale)) for x in PROMPT_RANGE)
    out = []
    for _ in range(n):
        p = min(max(round(rng.gauss(PROMPT_MEAN * scale, PROMPT_SD * scale)), plo), phi)
        r = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        if max_len is not None:
            p = min(p, max_len // 4)
            r = max(1, min(r, max_len - p))
        out.append((p, r))
    return out


def fill_rows(rows: int, row_tokens: int, seed: int = 0, ragged_multiple: Optional[int] = None,
              **draw_kw) -> list[tuple[int, int]]:
    """(prompt, response) lengths that the packer puts in exactly `rows` rows of at most `row_tokens`:
    sequences are added in draw order while they still fit in `rows` rows."""
    from m2po_megatron.actor.packing import pack_by_token_budget

    if rows < 1 or row_tokens < 2:
        raise ValueError(f"rows={rows} must be >= 1 and row_tokens={row_tokens} >= 2")
    pool = draw_lengths(64 * rows + 64, seed, max_len=row_tokens, **draw_kw)
    chosen: list[tuple[int, int]] = []
    for pr in pool:
        if len(pack_by_token_budget([sum(x) for x in chosen + [pr]], row_tokens)) > rows:
            break  # one sequence adds at most one row: `rows` rows are full
        chosen.append(pr)
    if ragged_multiple:
        chosen = _make_ragged(chosen, row_tokens, ragged_multiple)
    return chosen


def _make_ragged(lens: list[tuple[int, int]], row_tokens: int, m: int) -> list[tuple[int, int]]:
    from m2po_megatron.actor.packing import pack_by_token_budget

    lens = list(lens)
    for _ in range(100):
        bins = pack_by_token_budget([sum(x) for x in lens], row_tokens)
        even = [b for b in bins if sum(sum(lens[i]) for i in b) % m == 0]
        if not even:
            return lens
        for b in even:  # shorten the longest response of the row by one token (the row keeps fitting)
            i = max(b, key=lambda j: lens[j][1])
            lens[i] = (lens[i][0], lens[i][1] - 1)
    raise RuntimeError(f"could not make every row's length a non-multiple of {m}")


def row_lengths(lens: Sequence[tuple[int, int]], row_tokens: int) -> list[int]:
    """The packed rows' token counts (what the actor's rows hold before its own padding)."""
    from m2po_megatron.actor.packing import pack_by_token_budget

    return [sum(sum(lens[i]) for i in b) for b in pack_by_token_budget([sum(x) for x in lens], row_tokens)]


def make_batch(lens: Sequence[tuple[int, int]], vocab: int, seed: int = 0):
    """A TrainBatch of these lengths: random token ids, behaviour log-probs near a uniform model's
    (-log V + 0.05 noise, so the M2PO mask has work), advantages +-1."""
    import torch

    from m2po_megatron.actor.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (p + r,), generator=g) for p, r in lens]
    behav = [-math.log(vocab) + 0.05 * torch.randn(r, generator=g) for _, r in lens]
    adv = torch.where(torch.rand(len(lens), generator=g) < 0.5, -1.0, 1.0)
    return TrainBatch(ids, [p for p, _ in lens], behav, adv)


def rollout_batch(rows: int, row_tokens: int, vocab: int, seed: int = 0, ragged_multiple: Optional[int] = None,
                  **draw_kw):
    """fill_rows + make_batch: the benchmark's mini-batch for `rows` packed rows."""
    return make_batch(fill_rows(rows, row_tokens, seed, ragged_multiple, **draw_kw), vocab, seed)


def legacy_batch(n: int, vocab: int, max_len: int, seed: int = 0):
    """The earlier gpu_check batch, kept for comparison with turn 2's figures (4,096-token rows): prompt
    32-400 tokens + a lognormal response (median ~900), each at most max_len."""
    rng = random.Random(seed)
    lens = []
    for _ in range(n):
        p = min(rng.randint(32, 400), max_len // 4)
        lens.append((p, max(8, min(max_len - p, int(rng.lognormvariate(6.8, 0.8))))))
    return make_batch(lens, vocab, seed)
