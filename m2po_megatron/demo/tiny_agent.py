"""The tool-use task of `make demo-agent`: two-digit products the tiny model cannot compute in its head, and a
calculator it may call (m2po_megatron/examples/calculator.py, the rollout function the recipe names).

    prompt       <s><|user|>Compute 37*48. Put the answer in \\boxed{}.<|assistant|>
    policy       <call name="calc">37*48</call>
    environment  <result>1776</result>
    policy       \\boxed{1776}</s>

The tokenizer is the embedded default's (demo/tiny_tokenizer.py) plus four non-special added tokens:
`<call name="calc">`, `</call>` (the end of a call: one token, so that a call turn stops at it through
`stop_token_ids`, the only stop SGLang takes when started without a tokenizer), `<result>` and `</result>`.
Non-special: decoding keeps them with or without skip_special_tokens, so the tool parser and the reward
see the call's text.

The warm-up is supervised on traces in exactly the rollout's token format (each segment tokenized on its
own, as the rollout function appends them; the environment's tokens masked out of the loss). A fraction
``p_call`` of the traces call the calculator; the others answer directly (the right product, which the
model cannot learn to compute). It stops as soon as the success of sampled episodes (temperature 1, the
example rollout function itself run on the warmed-up model, math-verify reward of the policy's tokens) on a
calibration set reaches ``target_success``. RL then has two things to learn: to call the tool rather than
guess, and to copy the operands into the call and the result into ``\\boxed{}`` without slips.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .synthetic import TEMPLATE
from .tiny_model import (EVAL_FILE, INFO_FILE, TRAIN_FILE, TinyModelSpec, TinyTaskPaths, chat_prompt, pad_batch,
                         save_task, tiny_lm, warmup_loss)

SOURCE = "synthetic/calculator"
CALL_OPEN, CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE = '<call name="calc">', "</call>", "<result>", "</result>"
ADDED_TOKENS = (CALL_OPEN, CALL_CLOSE, RESULT_OPEN, RESULT_CLOSE)
SPLITS = ("eval", "calibration", "train", "warmup")


@dataclass(frozen=True)
class ProductSpec:
    """Problems a*b with both factors in [min_value, max_value] (ordered pairs). The default's products all have
    four digits: the answer then copies the result from a fixed distance back, which the tiny model learns."""

    min_value: int = 32
    max_value: int = 99

    def __post_init__(self):
        if not 0 <= self.min_value <= self.max_value:
            raise ValueError(f"need 0 <= min_value <= max_value, got {self.min_value}, {self.max_value}")

    @property
    def space(self) -> int:
        return (self.max_value - self.min_value + 1) ** 2


DEFAULT_AGENT_SPEC = ProductSpec()


def build_agent_tokenizer():
    """The embedded default's tokenizer with the tool-call tokens added (non-special)."""
    from .tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.add_tokens(list(ADDED_TOKENS), special_tokens=False)
    return tok


def problem_row(a: int, b: int, split: str, index: int) -> dict:
    expression = f"{a}*{b}"
    return {"id": f"{SOURCE}/{split}/{index:05d}", "prompt": TEMPLATE.format(problem=f"Compute {expression}."),
            "answer": str(a * b), "source": SOURCE, "problem": f"Compute {expression}.", "expression": expression}


def agent_splits(seed: int, spec: ProductSpec, n_eval: int, n_calibration: int, n_train: int,
                 max_warmup: int) -> dict[str, list[dict]]:
    """Disjoint slices of the problem space in a seeded random order: eval, calibration, RL train, and the
    warm-up's problems (all the rest, up to max_warmup; the warm-up never sees an RL or held-out problem)."""
    sizes = {"n_eval": n_eval, "n_calibration": n_calibration, "n_train": n_train}
    for name, n in sizes.items():
        if n < 1:
            raise ValueError(f"{name} must be at least 1, got {n}")
    used = n_eval + n_calibration + n_train
    if spec.space - used < 1:
        raise ValueError(f"n_eval + n_calibration + n_train = {used} leaves no warm-up problem in the spec's "
                         f"{spec.space:,}; lower them")
    r = range(spec.min_value, spec.max_value + 1)
    pairs = [(a, b) for a in r for b in r]
    random.Random(f"{seed}/agent-space").shuffle(pairs)
    cuts = [0, n_eval, n_eval + n_calibration, used, used + max_warmup]
    return {k: [problem_row(a, b, k, i) for i, (a, b) in enumerate(pairs[lo:hi])]
            for k, lo, hi in zip(SPLITS, cuts, cuts[1:])}


def trace_segments(tok, row: dict, call: bool) -> list[tuple[list[int], int]]:
    """The warm-up trace of a row as (token ids, trained) segments, each tokenized on its own exactly as the
    rollout function appends it: prompt (not trained), then with ``call`` the policy's call, the environment's
    result (not trained) and the policy's answer; without, the answer alone. The answer ends with EOS."""
    from ..examples.calculator import environment_text, evaluate, format_value

    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    answer = enc(f"\\boxed{{{row['answer']}}}") + [tok.eos_token_id]
    if not call:
        return [(enc(row["prompt"]), 0), (answer, 1)]
    result = environment_text(format_value(evaluate(row["expression"])))
    return [(enc(row["prompt"]), 0), (enc(f"{CALL_OPEN}{row['expression']}{CALL_CLOSE}"), 1), (enc(result), 0),
            (answer, 1)]


class HFTokenClient:
    """An `api.TokenClient` over a Hugging Face model in this process, for running a rollout function without
    servers (the warm-up's checks). Concurrent requests are batched: `run` drives the episodes and generates
    for every request they wait on at once. Log-probs are not computed (0.0); seeds are ignored (torch's
    global generator samples)."""

    def __init__(self, model, tok, batch_size: int = 128):
        self.model, self.tok, self.batch_size = model, tok, batch_size
        self.pending: list[tuple[list[int], dict, int, asyncio.Future]] = []

    async def generate(self, input_ids, sampling_params=None, *, n: int = 1, seed=None):
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((list(input_ids), dict(sampling_params or {}), n, fut))
        return await fut

    def _flush(self) -> None:
        from ..api import Generation
        from ..eval.hf_generate import hf_generate_fn

        batch, self.pending = self.pending, []
        groups: dict[tuple, list] = {}
        for ids, sp, n, fut in batch:
            key = (tuple(sp.get("stop_token_ids") or ()), float(sp.get("temperature", 1.0)),
                   float(sp.get("top_p", 1.0)), int(sp.get("max_new_tokens", 32)), n)
            groups.setdefault(key, []).append((ids, fut))
        for (stops, temperature, top_p, max_new, n), reqs in groups.items():
            stop_ids = set(stops) | {self.tok.eos_token_id}
            gen = hf_generate_fn(self.model, self.tok.pad_token_id, sorted(stop_ids), self.batch_size, seed=None)
            outs = gen([ids for ids, _ in reqs], n, temperature, top_p, max_new)
            for (_, fut), samples in zip(reqs, outs):
                fut.set_result([Generation(list(o), [0.0] * len(o), [0] * len(o),
                                           "stop" if o and o[-1] in stop_ids else "length") for o in samples])

    async def run(self, coros):
        task = asyncio.ensure_future(asyncio.gather(*coros))
        while not task.done():
            for _ in range(4):  # let every episode run up to its next request
                await asyncio.sleep(0)
            if self.pending:
                self._flush()
        return task.result()


def episode_success(model, tok, rows: list[dict], seed: int, temperature: float = 1.0,
                    max_new_tokens: int = 24) -> dict:
    """One episode per row with the example rollout function (the calculator) on ``model``: the fraction
    answered correctly (math-verify of the decoded policy tokens, as the recipe's reward scores them), and the
    means of what the rollout function logs (turns, tool_calls, used_tool, tool_call_success)."""
    import torch

    from ..api import RolloutContext, tool_parser
    from ..examples.calculator import rollout
    from ..reward import math_verify_reward

    torch.manual_seed(seed)
    client = HFTokenClient(model, tok)
    logs: dict[str, list[float]] = {}
    parser = tool_parser("m2po_tags")

    def log(**kw):
        for k, v in kw.items():
            logs.setdefault(k, []).append(float(v))

    async def no_reward(text):  # the rollout function leaves the reward to the recipe (None)
        raise AssertionError("unused")

    ctxs = [RolloutContext(row=r, prompt_ids=tok(r["prompt"], add_special_tokens=False)["input_ids"], tokenizer=tok,
                           sampling_params={"temperature": temperature, "top_p": 1.0,
                                            "max_new_tokens": max_new_tokens},
                           n=1, seed=seed + i, client=client, reward=no_reward, log=log,
                           max_context=model.config.max_position_embeddings, tool_parser=parser)
            for i, r in enumerate(rows)]
    model.eval()
    results = asyncio.run(client.run([rollout(c) for c in ctxs]))
    correct = 0
    for r, (res,) in zip(rows, results):
        policy = [t for t, m in zip(res.token_ids, res.loss_mask) if m]
        correct += math_verify_reward(tok.decode(policy, skip_special_tokens=True), r["answer"]) == 1.0
    out = {"success": correct / len(rows)}
    out.update({k: sum(v) / len(v) for k, v in logs.items()})
    return out


def _check_reload(out: Path, tok, rows: list[dict]) -> None:
    """AutoTokenizer on the model directory must tokenize every trace segment as the warm-up's tokenizer did,
    with the end of a call one token."""
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(out)
    for r in rows:
        if trace_segments(again, r, True) != trace_segments(tok, r, True):
            raise RuntimeError(f"{out}: the saved tokenizer reloads as {type(again).__name__} and tokenizes "
                               "differently from the one used for the warm-up")
    if len(again.encode(CALL_CLOSE, add_special_tokens=False)) != 1:
        raise RuntimeError(f"{out}: {CALL_CLOSE!r} is not one token after reloading the tokenizer")


def build_tiny_agent_task(out_dir: str | Path, seed: int = 0, *, n_train: int = 512, n_eval: int = 128,
                          n_calibration: int = 128, spec: ProductSpec = DEFAULT_AGENT_SPEC,
                          model: TinyModelSpec = TinyModelSpec(), target_success: float = 0.3,
                          p_call: float = 0.5, max_warmup_steps: int = 600, check_every: int = 20,
                          batch_size: int = 32, lr: float = 3e-3, log=print) -> TinyTaskPaths:
    """Write the tool-use task to ``out_dir`` (tokenizer with the call tokens, a warmed-up tiny Qwen2,
    train/eval JSONL, build_info.json) and return its paths. Eval, calibration, train and warm-up problems are
    disjoint."""
    import torch

    if not 0 < target_success < 1:
        raise ValueError(f"target_success must be in (0, 1), got {target_success}")
    if not 0 <= p_call <= 1:
        raise ValueError(f"p_call must be in [0, 1], got {p_call}")
    if check_every < 1:
        raise ValueError(f"check_every must be at least 1, got {check_every}")
    out = Path(out_dir)
    t_start = time.monotonic()
    splits = agent_splits(seed, spec, n_eval, n_calibration, n_train, min(max_warmup_steps * batch_size, 20000))
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # determinism across machines, and fairness on a shared one
    try:
        tok = build_agent_tokenizer()
        for rows in splits.values():
            for r in rows:  # the training format's prompt is the final text fed to the tokenizer
                r["prompt"] = chat_prompt(tok, r["prompt"])
                r["chat_template"] = True  # a run must not wrap it again (data.apply_chat_template)
        eval_rows, calib_rows, train_rows, warm_rows = (splits[k] for k in SPLITS)
        pick = random.Random(f"{seed}/agent-call")
        traces = [trace_segments(tok, r, pick.random() < p_call) for r in warm_rows]

        torch.manual_seed(seed)
        lm = tiny_lm(tok, model, None)
        opt = torch.optim.AdamW(lm.parameters(), lr=lr, weight_decay=0.0)

        def batch(items):
            seqs = [[t for ids, _ in segs for t in ids] for segs in items]
            labels = [[t if m else -100 for ids, m in segs for t in ids] for segs in items]
            return pad_batch(seqs, labels, tok.pad_token_id)

        order = random.Random(f"{seed}/order").sample(range(len(traces)), len(traces))
        history, step = [], 0
        while step < max_warmup_steps:
            lm.train()
            ids, lab, att = batch([traces[order[(step * batch_size + j) % len(order)]] for j in range(batch_size)])
            loss = warmup_loss(lm, ids, att, lab, None)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
            opt.step()
            step += 1
            if step % check_every == 0:
                stats = episode_success(lm, tok, calib_rows, seed=seed + step)
                history.append({"step": step, "loss": round(loss.item(), 4),
                                **{k: round(v, 4) for k, v in stats.items()}})
                log(f"warm-up step {step}: loss {loss.item():.3f}, sampled success {stats['success']:.3f}, "
                    f"tool used {stats.get('used_tool', 0):.2f}, calls ok {stats.get('tool_call_success', 0):.2f}")
                if stats["success"] >= target_success:
                    break
        final = episode_success(lm, tok, eval_rows, seed=seed + 10**6)
        log(f"warm-up done after {step} steps: held-out sampled success {final['success']:.3f}")

        save_task(out, lm, tok, train_rows, eval_rows, max_new_tokens=24, check_reload=_check_reload)
        info = {"task": "calculator", "seed": seed, "spec": asdict(spec), "model": asdict(model),
                "warmup_steps": step, "target_success": target_success, "p_call": p_call,
                "check_every": check_every, "eval_sampled_success": final["success"], "eval_episode": final,
                "history": history, "n_train": n_train, "n_eval": n_eval, "n_calibration": n_calibration,
                "n_warmup_problems": len(warm_rows), "added_tokens": list(ADDED_TOKENS),
                "build_seconds": round(time.monotonic() - t_start, 1),
                "parameters": sum(p.numel() for p in lm.parameters())}
        (out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    finally:
        torch.set_num_threads(threads)
    return TinyTaskPaths(str(out), str(out / TRAIN_FILE), str(out / EVAL_FILE), str(out / INFO_FILE))
