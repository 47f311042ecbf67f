"""The embedded default's task: seeded multi-step integer sums answered in ``\\boxed{}``.

"Compute 12+7+25. Put the answer in \\boxed{}." -> solution "12+7=19 19+25=44 \\boxed{44}". The answer is
checked by the same math-verify reward as the real recipe. Rows are in the project's training format
(id, prompt, answer, source) plus ``problem`` and ``solution`` (the worked steps used for the warm-up).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

SOURCE = "synthetic/sums"
TEMPLATE = "{problem} Put the answer in \\boxed{{}}."


@dataclass(frozen=True)
class SumSpec:
    """Difficulty: how many terms (inclusive range) and the largest term."""

    min_terms: int = 2
    max_terms: int = 3
    max_value: int = 30

    def __post_init__(self):
        if not 2 <= self.min_terms <= self.max_terms:
            raise ValueError(f"need 2 <= min_terms <= max_terms, got {self.min_terms}, {self.max_terms}")
        if self.max_value < 1:
            raise ValueError(f"max_value must be >= 1, got {self.max_value}")

    @property
    def space(self) -> int:
        """Number of distinct problems."""
        return sum((self.max_value + 1) ** k for k in range(self.min_terms, self.max_terms + 1))


def make_problem(rng: random.Random, spec: SumSpec = SumSpec()) -> dict:
    """The number of terms first (uniform), then the terms: each 2-term sum is far likelier than each 3-term one."""
    return problem_of([rng.randint(0, spec.max_value) for _ in range(rng.randint(spec.min_terms, spec.max_terms))])


def problem_of(terms: list[int]) -> dict:
    steps, acc = [], terms[0]
    for t in terms[1:]:
        steps.append(f"{acc}+{t}={acc + t}")
        acc += t
    problem = "Compute " + "+".join(map(str, terms)) + "."
    return {"problem": problem, "answer": str(acc), "solution": " ".join(steps) + f" \\boxed{{{acc}}}"}


def generate_problems(n: int, seed: int, spec: SumSpec = SumSpec(), exclude: set[str] | None = None,
                      split: str = "train") -> list[dict]:
    """``n`` distinct problems (by text), none of them in ``exclude``; deterministic given ``seed``."""
    space = spec.space
    taken = set(exclude or ())
    if n > space - len(taken):
        raise ValueError(f"asked for {n} distinct problems but the spec only has {space} ({len(taken)} excluded)")
    rng = random.Random(f"{seed}/{split}")
    rows: list[dict] = []
    while len(rows) < n:
        p = make_problem(rng, spec)
        if p["problem"] in taken:
            continue
        taken.add(p["problem"])
        rows.append(as_row(p, split, len(rows)))
    return rows


def as_row(p: dict, split: str, index: int) -> dict:
    """A problem in the training format (id, prompt, answer, source) plus its problem and worked solution."""
    return {"id": f"{SOURCE}/{split}/{index:05d}", "prompt": TEMPLATE.format(problem=p["problem"]),
            "answer": p["answer"], "source": SOURCE, **{k: p[k] for k in ("problem", "solution")}}


def shuffled_space(seed: int, spec: SumSpec = SumSpec()) -> list[dict]:
    """Every distinct problem of ``spec`` once, in a seeded random order: consecutive slices of it are
    disjoint splits with the same mix of term counts (unlike draws by make_problem, which exhaust the few
    2-term sums first)."""
    space = [problem_of(list(t)) for k in range(spec.min_terms, spec.max_terms + 1)
             for t in itertools.product(range(spec.max_value + 1), repeat=k)]
    random.Random(f"{seed}/space").shuffle(space)
    return space
