#!/usr/bin/env python
"""Write the Countdown example's data: train.jsonl and eval.jsonl beside this script (or in --out).

Each row: `id`, `prompt` (plain text; the recipe's data.apply_chat_template wraps it), `numbers` (2 or 3 digits
1-9), `target` and `solution` (one worked chain that reaches it; the reward does not read it). The target is the
left-to-right value of the numbers in a random order joined by random operators (+ twice as likely as - or *),
so every target is reachable with each number used once, and about a quarter are the plain sum of the numbers,
what the tiny model's warm-up on sums prepared it for. A draw is made again when an intermediate result is below
1 (Countdown's rule), or the target is above 99 or equal to a given number (no work to do). The problems are
distinct (as the multiset of numbers and the target), and the splits are cut from one shuffled list: eval and
train are disjoint and have the same mix.

The prompt reads "Compute 7,1,5 = 28. Put the answer in \\boxed{}.": the tiny model was warmed up only on
"Compute 7+1+5. Put the answer in \\boxed{}.", and of the phrasings tried this one kept the most of what it
knows (docs/tasks.md). Deterministic: the same seed writes byte-identical files.

Usage: python examples/countdown/make_data.py [--out DIR] [--seed 0] [--n-train 512] [--n-eval 128]
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OPS = "++-*"  # drawn uniformly: + twice as often as - or *
PROMPT = "Compute {numbers} = {target}. Put the answer in \\boxed{{}}."


def make_problem(rng: random.Random) -> dict | None:
    """One problem, or None when the draw is rejected (an intermediate result below 1, the target above 99 or
    equal to a given number)."""
    numbers = [rng.randint(1, 9) for _ in range(rng.randint(2, 3))]
    order = rng.sample(numbers, len(numbers))
    value, steps = order[0], []
    for x in order[1:]:
        op = rng.choice(OPS)
        result = value + x if op == "+" else value - x if op == "-" else value * x
        if result < 1:  # Countdown's rule: every intermediate result is a positive integer
            return None
        steps.append(f"{value}{op}{x}={result}")
        value = result
    if not 1 <= value <= 99 or value in numbers:
        return None
    return {"numbers": numbers, "target": value, "solution": " ".join(steps) + f" \\boxed{{{value}}}"}


def generate(n: int, seed: int) -> list[dict]:
    """`n` distinct problems (by the multiset of numbers and the target) in a seeded random order."""
    rng = random.Random(f"countdown/{seed}")
    seen, problems = set(), []
    for _ in range(1000 * n):  # about 1,800 distinct problems exist: asking for more would never end
        if len(problems) == n:
            break
        p = make_problem(rng)
        if p is None or (key := (tuple(sorted(p["numbers"])), p["target"])) in seen:
            continue
        seen.add(key)
        problems.append(p)
    if len(problems) < n:
        raise ValueError(f"found only {len(problems)} distinct problems of the {n} asked; lower --n-train or "
                         "--n-eval")
    rng.shuffle(problems)  # so that eval and train have the same mix (2-number problems run out first)
    return problems


def as_row(p: dict, split: str, index: int) -> dict:
    prompt = PROMPT.format(numbers=",".join(map(str, p["numbers"])), target=p["target"])
    return {"id": f"countdown/{split}/{index:04d}", "prompt": prompt, **p}


def write(rows: list[dict], path: Path) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent), help="directory to write into")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-train", type=int, default=512)
    ap.add_argument("--n-eval", type=int, default=128)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    problems = generate(args.n_eval + args.n_train, args.seed)
    eval_rows = [as_row(p, "eval", i) for i, p in enumerate(problems[:args.n_eval])]
    train_rows = [as_row(p, "train", i) for i, p in enumerate(problems[args.n_eval:])]
    write(train_rows, out / "train.jsonl")
    write(eval_rows, out / "eval.jsonl")
    print(f"wrote {len(train_rows)} train and {len(eval_rows)} eval problems to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
