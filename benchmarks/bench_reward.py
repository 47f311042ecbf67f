#!/usr/bin/env python
"""Reward throughput (items/s): serial math-verify loop vs RewardPool with 1, 2, 4 workers, and eval
throughput (samples/s) of the tiny task's model through the eval core.

    .venv/bin/python benchmarks/bench_reward.py [--items 600] [--tiny-model DIR]

Items are MATH-500 gold answers (the shipped copy) turned into responses: correct (boxed gold after some
text), wrong (boxed perturbed answer) and unboxed, in equal parts. Pool start-up is excluded (the training
loop keeps one pool for the whole run); ratios are against the serial loop of the same run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time


def make_items(n: int):
    from m2po_megatron.data.prepare import shipped_eval_dir

    with gzip.open(shipped_eval_dir() / "math500.jsonl.gz", "rt") as f:
        golds = [json.loads(line)["answer"] for line in f]
    responses, answers = [], []
    for i in range(n):
        g = golds[i % len(golds)]
        kind = i % 3
        if kind == 0:
            r = f"Let us work it out step by step. Therefore the answer is \\boxed{{{g}}}."
        elif kind == 1:
            r = f"After simplifying we get \\boxed{{{g} + 1}}."
        else:
            r = "I am not sure how to finish this problem."
        responses.append(r)
        answers.append(g)
    return responses, answers


def bench_reward(n: int, timeout_s: float) -> list[dict]:
    from m2po_megatron.reward import RewardInput, RewardPool, judge

    responses, answers = make_items(n)
    items = [RewardInput(r, [], {"answer": a}) for r, a in zip(responses, answers)]
    judge(responses[0], answers[0])  # imports out of the timing
    t = time.perf_counter()
    serial = [judge(r, a).score for r, a in zip(responses, answers)]
    base = n / (time.perf_counter() - t)
    rows = [{"mode": "serial loop", "items_per_s": round(base, 1), "speedup": 1.0, "timeouts": 0}]
    for w in (1, 2, 4):
        with RewardPool(num_workers=w, timeout_s=timeout_s) as pool:
            pool.score(items[:w * 2])  # workers ready
            t = time.perf_counter()
            outs, st = pool.score(items)
            rate = n / (time.perf_counter() - t)
        scores = [o.score if o.score is not None else 0.0 for o in outs]
        if scores != serial and st.timeouts == 0:
            raise SystemExit(f"pool with {w} workers disagrees with the serial loop")
        rows.append({"mode": f"RewardPool({w})", "items_per_s": round(rate, 1), "speedup": round(rate / base, 2),
                     "timeouts": st.timeouts})
    return rows


def bench_eval(model_dir: str | None, problems: int, n: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from m2po_megatron.data.rows import RowOptions, load_task_rows
    from m2po_megatron.eval import EvalSet, evaluate, hf_generate_fn
    from m2po_megatron.reward import Rewards
    from m2po_megatron.reward.functions import terms_of

    torch.set_num_threads(1)
    if model_dir is None:
        from m2po_megatron.demo.tiny_model import build_tiny_task

        model_dir = build_tiny_task(tempfile.mkdtemp(prefix="tiny-bench-"), seed=0, log=lambda s: None).model_dir
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = load_task_rows(os.path.join(model_dir, "eval.jsonl"), RowOptions(apply_chat_template=False), tok)[:problems]
    gen = hf_generate_fn(model, tok.pad_token_id, tok.eos_token_id, seed=0)
    out = {}
    for label, pool in (("serial reward", None), ("RewardPool(2)", Rewards(terms_of({}), num_workers=2,
                                                                             timeout_s=10.0))):
        if pool is not None:
            from m2po_megatron.reward import RewardInput

            pool.score([RewardInput("\\boxed{1}", [], {"answer": "1"})] * 2)
        t = time.perf_counter()
        res = evaluate(gen, tok, [EvalSet("sums", rows, n)], temperature=1.0, top_p=1.0, max_new_tokens=32,
                       rewards=pool)
        dt = time.perf_counter() - t
        if pool is not None:
            pool.close()
        out[label] = {"samples_per_s": round(problems * n / dt, 1), "pass@1": round(100 * res.average, 1),
                      "mean_response_tokens": round(res.benchmarks[0].mean_response_tokens, 1)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=600)
    ap.add_argument("--timeout-s", type=float, default=10.0)
    ap.add_argument("--tiny-model", help="a build_tiny_task output dir (built in a temp dir when absent)")
    ap.add_argument("--eval-problems", type=int, default=128)
    ap.add_argument("--eval-samples", type=int, default=4)
    args = ap.parse_args()
    reward = bench_reward(args.items, args.timeout_s)
    print("| reward scoring | items/s | vs serial |\n|---|---|---|")
    for r in reward:
        print(f"| {r['mode']} | {r['items_per_s']} | {r['speedup']}x |")
    ev = bench_eval(args.tiny_model, args.eval_problems, args.eval_samples)
    print("\n| eval (tiny model, HF generate, 1 torch thread) | samples/s | pass@1 % |\n|---|---|---|")
    for k, v in ev.items():
        print(f"| {k} | {v['samples_per_s']} | {v['pass@1']} |")
    print(json.dumps({"reward": reward, "eval": ev, "cpus": os.cpu_count(),
                      "loadavg": os.getloadavg()}, indent=1), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
