"""pass@1 (avg@k) on math benchmarks, against any generation callable.

``generate_fn(prompt_ids, n, temperature, top_p, max_new_tokens)`` -> per prompt, ``n`` lists of output
token ids (the training loop passes its rollout client, tests a HF model's ``generate``). Each sample is
decoded with the tokenizer, scored by math-verify on its last ``\\boxed{}``; a benchmark's pass@1 is the
mean over problems of the fraction of its k samples that are correct, and the average is the unweighted
mean over benchmarks (the paper's "Avg").
"""

from __future__ import annotations

import csv
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from ..data.rows import TaskRow

GenerateFn = Callable[[list[list[int]], int, float, float, int], list[list[list[int]]]]


@dataclass
class EvalSet:
    name: str
    rows: list["TaskRow"]  # prompt_ids as the model sees them, the reference answer in label
    n_samples: int = 4

    def __post_init__(self):
        from ..data.rows import TaskRow

        if self.n_samples < 1:
            raise ValueError(f"eval set {self.name}: n_samples must be >= 1, got {self.n_samples}")
        if not self.rows:
            raise ValueError(f"eval set {self.name} is empty")
        for i, r in enumerate(self.rows):
            if not isinstance(r, TaskRow):
                raise ValueError(f"eval set {self.name} row {i}: a {type(r).__name__}, not a TaskRow; read the set "
                                 f"with m2po_megatron.data.rows.load_task_rows (or load_eval_sets)")
            if not r.prompt_ids and not r.prompt:
                raise ValueError(f"eval set {self.name} row {i} ({r.id}): no prompt")


# File stems that name a split, not a set: such a file is named by its directory (.cache/tiny-task/eval.jsonl
# -> tiny-task), so its metrics read eval/tiny-task/pass@1 rather than eval/eval/pass@1.
SPLIT_STEMS = {"eval", "evaluation", "test", "val", "valid", "validation", "dev", "heldout", "held_out", "data"}


def eval_set_names(paths: list[str]) -> list[str]:
    """The metric name of each data.eval_paths entry (eval/<name>/pass@1): the file name before its first dot
    (math500.jsonl -> math500), a shard suffix dropped (test-00000-of-00001.parquet -> test), and a split's
    name replaced by the nearest directory that is not one. Two entries with one name would share metrics:
    a ValueError naming both."""
    import re

    names = []
    for p in paths:
        path = Path(p).expanduser().absolute()
        name = re.sub(r"-\d+-of-\d+$", "", path.name.split(".")[0])
        for parent in path.parents:
            if name.lower() not in SPLIT_STEMS or not parent.name:
                break
            name = parent.name
        names.append(name)
    for i, n in enumerate(names):
        if n in names[:i]:
            j = names.index(n)
            raise ValueError(f"data.eval_paths[{j}] ({paths[j]}) and data.eval_paths[{i}] ({paths[i]}) are both "
                             f"named {n!r} (eval/{n}/pass@1); rename one file or its directory")
    return names


@dataclass
class BenchmarkScore:
    name: str
    problems: int
    samples_per_problem: int
    pass_at_1: float          # avg@k, as a fraction
    boxed_rate: float         # fraction of samples with an extractable answer
    mean_response_tokens: float
    truncated_rate: float     # fraction of samples that used all max_new_tokens without EOS
    reward_timeouts: int
    reward_errors: int


@dataclass
class EvalResult:
    benchmarks: list[BenchmarkScore]
    average: float
    step: int | None
    settings: dict
    seconds: float
    files: dict = field(default_factory=dict)
    samples: dict | None = None  # name -> per problem list of decoded responses (when asked)

    def metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """Flat numbers for a metrics logger: eval/<name>/pass@1 and eval/avg/pass@1, in percent."""
        out = {f"{prefix}{b.name}/pass@1": 100 * b.pass_at_1 for b in self.benchmarks}
        out.update({f"{prefix}{b.name}/boxed_rate": b.boxed_rate for b in self.benchmarks})
        out[f"{prefix}avg/pass@1"] = 100 * self.average
        return out

    def table(self) -> list[dict]:
        rows = [{"benchmark": b.name, "problems": b.problems, "samples": b.samples_per_problem,
                 "pass@1": round(100 * b.pass_at_1, 2)} for b in self.benchmarks]
        rows.append({"benchmark": "avg", "problems": sum(b.problems for b in self.benchmarks), "samples": "",
                     "pass@1": round(100 * self.average, 2)})
        return rows


def load_eval_sets(eval_dir: str | Path, names: list[str] | None = None,
                   n_samples: dict[str, int] | int | None = None, limit: int | None = None, *, tokenizer=None,
                   data_cfg=None, require_label: bool = True) -> list[EvalSet]:
    """Eval files ``<eval_dir>/<name>.{jsonl,jsonl.gz,json,parquet}`` (e.g. from `m2po prepare-data`) as TaskRows.
    ``n_samples`` defaults to the paper's (16 for AIME, 4 otherwise); ``limit`` keeps the first rows of each set
    (smoke tests). ``data_cfg`` (the recipe's ``data``) maps the columns; by default a prepared file's
    ``prompt`` is used as it is (no chat template added) and its ``answer`` is the label. Without a
    ``tokenizer`` the rows are checked and their text prompts encoded later, by evaluate()."""
    from ..data.prepare import EVAL_SETS, find_eval_file
    from ..data.rows import RowOptions, load_task_rows

    eval_dir = Path(eval_dir)
    if not eval_dir.is_dir():
        raise FileNotFoundError(f"eval directory {eval_dir} does not exist; prepare it with `m2po prepare-data "
                                f"--out DIR` (the sets are in DIR/eval)")
    if data_cfg is None:  # prepared prompts are final text; an eval has no prompt length limit of its own
        data_cfg = RowOptions(apply_chat_template=False, max_prompt_len=2**62)
    if names is None:
        names = sorted(n for n in {p.name.split(".")[0] for p in eval_dir.iterdir() if p.is_file()}
                       if find_eval_file(eval_dir, n) is not None)
    sets = []
    for name in names:
        f = find_eval_file(eval_dir, name)
        if f is None:
            raise FileNotFoundError(f"eval set {name!r}: no {name}.jsonl in {eval_dir}; run `m2po prepare-data`")
        k = n_samples if isinstance(n_samples, int) else (n_samples or {}).get(name, EVAL_SETS.get(name, 4))
        # a DataError (a ValueError) names the set, the file, the line or row and the column
        rows = load_task_rows(str(f), data_cfg, tokenizer, require_label=require_label, key=f"eval set {name}")
        sets.append(EvalSet(name, rows[:limit] if limit else rows, k))
    if not sets:
        raise FileNotFoundError(f"no eval sets found in {eval_dir}")
    return sets


def evaluate(generate_fn: GenerateFn, tokenizer, eval_sets: list[EvalSet], *, temperature: float = 1.0,
             top_p: float = 0.7, max_new_tokens: int = 2560, rewards=None, out_dir: str | Path | None = None,
             step: int | None = None, prompt_batch: int = 64, keep_samples: bool = False,
             log: Callable[[str], None] | None = None) -> EvalResult:
    """Generate ``n_samples`` per problem for every set, score, and (with ``out_dir``) write
    ``eval/step_<step>.json`` and ``.csv`` (or ``eval/eval.*`` without a step) plus a row in
    ``eval/summary.csv``. Defaults follow the paper's evaluation (temperature 1, top_p 0.7).

    ``rewards``: the run's reward (reward/compose.Rewards, or the loop's LockedRewards); a sample passes when
    its reward's `acc` is 1 (math_verify gives it), or, for a reward without `acc`, when its score is >= 1.
    None: math-verify in this process against each row's label."""
    from ..data.prepare import encode_prompt
    from ..reward.extract import last_boxed
    from ..reward.math_verify_reward import ERROR, judge

    if not eval_sets:
        raise ValueError("evaluate() needs at least one eval set")
    if not (temperature >= 0 and 0 < top_p <= 1 and max_new_tokens >= 1):
        raise ValueError(f"bad sampling settings: temperature={temperature} (>= 0), top_p={top_p} (0, 1], "
                         f"max_new_tokens={max_new_tokens} (>= 1)")
    if rewards is None:  # math-verify against each row's label below
        for es in eval_sets:
            for r in es.rows:
                if r.label is None:
                    raise ValueError(f"eval set {es.name} row {r.id}: no label (reference answer) to judge against; "
                                     f"set data.label_key to the column that holds it")
    t0 = time.monotonic()
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    scores_out, samples = [], {}
    for es in eval_sets:
        # rows read without a tokenizer (load_eval_sets for `m2po eval`) carry their text prompt only
        prompts = [r.prompt_ids or encode_prompt(tokenizer, r.prompt) for r in es.rows]
        outputs: list[list[list[int]]] = []
        for b in range(0, len(prompts), prompt_batch):
            chunk = prompts[b : b + prompt_batch]
            got = generate_fn(chunk, es.n_samples, temperature, top_p, max_new_tokens)
            if len(got) != len(chunk) or any(len(g) != es.n_samples for g in got):
                raise RuntimeError(f"generate_fn returned {len(got)} prompts x {[len(g) for g in got][:4]}... samples "
                                   f"for {len(chunk)} prompts x n={es.n_samples}")
            outputs += got
        texts = [[tokenizer.decode(o, skip_special_tokens=True) for o in outs] for outs in outputs]
        flat_resp = [t for ts in texts for t in ts]
        timeouts = errors = 0
        if rewards is not None:
            from ..reward.types import RewardInput

            items = [RewardInput(t, list(o), r.row, r.prompt) for r, ts, outs in zip(es.rows, texts, outputs)
                     for t, o in zip(ts, outs)]
            scored = rewards.score(items)
            passes = [float(x.acc >= 1.0) if x.acc is not None else float(x.score is not None and x.score >= 1.0)
                      for x in scored]
            timeouts = sum(x.failed == "timeout" for x in scored)
            errors = sum(x.failed not in (None, "timeout") for x in scored)
        else:
            passes = []
            for resp, r in zip(flat_resp, [r for r, ts in zip(es.rows, texts) for _ in ts]):
                v = judge(resp, r.label or "", 0.0)
                errors += v.status == ERROR
                passes.append(float(v.score == 1.0))
        k = es.n_samples
        per_problem = [sum(passes[i * k : (i + 1) * k]) / k for i in range(len(es.rows))]
        lengths = [len(o) for outs in outputs for o in outs]
        truncated = [len(o) >= max_new_tokens and not (o and o[-1] in eos) for outs in outputs for o in outs]
        bs = BenchmarkScore(es.name, len(es.rows), k, statistics.fmean(per_problem),
                            sum(last_boxed(t) is not None for t in flat_resp) / len(flat_resp),
                            statistics.fmean(lengths), sum(truncated) / len(truncated), timeouts, errors)
        scores_out.append(bs)
        if keep_samples:
            samples[es.name] = texts
        if log:
            log(f"eval {es.name}: pass@1 {100 * bs.pass_at_1:.2f}% over {bs.problems} problems x {k} samples")
    avg = statistics.fmean(b.pass_at_1 for b in scores_out)
    settings = {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens}
    res = EvalResult(scores_out, avg, step, settings, time.monotonic() - t0, samples=samples if keep_samples else None)
    if out_dir is not None:
        res.files = save_result(res, out_dir)
    return res


def save_result(res: EvalResult, out_dir: str | Path) -> dict:
    d = Path(out_dir) / "eval"
    d.mkdir(parents=True, exist_ok=True)
    stem = f"step_{res.step:06d}" if res.step is not None else "eval"
    payload = {"step": res.step, "average_pass@1": 100 * res.average, "settings": res.settings,
               "seconds": round(res.seconds, 2), "benchmarks": [asdict(b) for b in res.benchmarks]}
    (d / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
    with open(d / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["benchmark", "problems", "samples", "pass@1"])
        w.writeheader()
        w.writerows(res.table())
    summary = d / "summary.csv"
    names = [b.name for b in res.benchmarks]
    new = not summary.exists()
    with open(summary, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["step", *names, "avg"])
        w.writerow([res.step if res.step is not None else "", *[round(100 * b.pass_at_1, 2) for b in res.benchmarks],
                    round(100 * res.average, 2)])
    return {"json": str(d / f"{stem}.json"), "csv": str(d / f"{stem}.csv"), "summary": str(summary)}
