"""Build the embedded default's task: tokenizer + tiny Qwen2 model warmed up on synthetic sums + data.
With a TinyMoeSpec the model is a tiny Qwen3-MoE instead (the same task, tokenizer and warm-up; `make demo-moe`).

The warm-up is supervised on worked solutions and deliberately short: it stops as soon as sampled accuracy
(temperature 1, math-verify reward) on a calibration set reaches ``target_accuracy``, so RL starts from a
model that is sometimes right and has room to improve. Everything is local and deterministic given ``seed``
(one torch thread during the build).
"""

from __future__ import annotations

import itertools
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .synthetic import SumSpec, as_row, generate_problems, shuffled_space

TRAIN_FILE, EVAL_FILE, INFO_FILE = "train.jsonl", "eval.jsonl", "build_info.json"


@dataclass(frozen=True)
class TinyTaskPaths:
    model_dir: str  # HF model + tokenizer (AutoModelForCausalLM / AutoTokenizer load it)
    train_jsonl: str
    eval_jsonl: str
    info_json: str


@dataclass(frozen=True)
class TinyModelSpec:
    hidden_size: int = 96
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 128


@dataclass(frozen=True)
class TinyMoeSpec:
    """A tiny Qwen3-MoE's experts; attention, depth and width come from TinyModelSpec. Every layer is sparse (what
    models/hf_config.py accepts). Each expert is half the dense MLP, so top-2 computes about what the dense model
    does per token and 4 experts split evenly over EP 2."""
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    # Qwen3-MoE's own coefficient: load balancing that keeps the warm-up from collapsing onto one or two experts
    # without weighing on the supervised loss (see warmup_loss)
    router_aux_loss_coef: float = 0.001


def chat_prompt(tokenizer, prompt: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def sampled_accuracy(model, tokenizer, rows: list[dict], seed: int, temperature: float = 1.0,
                     max_new_tokens: int = 32) -> float:
    """Fraction of rows answered correctly by one sample each (math-verify on the decoded response)."""
    from ..eval.hf_generate import hf_generate_fn
    from ..reward import math_verify_reward

    gen = hf_generate_fn(model, tokenizer.pad_token_id, tokenizer.eos_token_id, batch_size=128, seed=seed)
    prompts = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    outs = gen(prompts, 1, temperature, 1.0, max_new_tokens)
    texts = [tokenizer.decode(o[0], skip_special_tokens=True) for o in outs]
    return sum(math_verify_reward(t, r["answer"]) == 1.0 for t, r in zip(texts, rows)) / len(rows)


DEFAULT_SPEC = SumSpec(min_terms=2, max_terms=3, max_value=9)  # 1,100 distinct problems


def save_task(out: Path, lm, tok, train_rows: list[dict], eval_rows: list[dict], max_new_tokens: int,
              check_reload=None) -> None:
    """The warmed-up model (sampling at temperature 1 by default), its tokenizer, checked to reload
    (check_reload(out, tok, rows); default: the sums task's texts tokenize alike), and the train/eval JSONL of a
    tiny task."""
    from transformers import GenerationConfig

    lm.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                            pad_token_id=tok.pad_token_id, do_sample=True, temperature=1.0,
                                            top_p=1.0, top_k=0, max_new_tokens=max_new_tokens)
    lm.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (check_reload or _check_reload)(out, tok, eval_rows[:8])
    for name, rows in ((TRAIN_FILE, train_rows), (EVAL_FILE, eval_rows)):
        with open(out / name, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


def pad_batch(seqs: list[list[int]], labels: list[list[int]], pad_id: int):
    """Right-padded (input ids, labels with -100 off the loss, attention mask) of a warm-up batch."""
    import torch

    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id)
    lab = torch.full((len(seqs), width), -100)
    att = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, l) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)], lab[i, : len(l)], att[i, : len(s)] = torch.tensor(s), torch.tensor(l), 1
    return ids, lab, att


def _check_reload(out: Path, tok, rows: list[dict]) -> None:
    """AutoTokenizer on the model directory must tokenize exactly as the tokenizer the model learned with."""
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(out)
    for r in rows:
        text = r["prompt"] + r["solution"]
        if again(text, add_special_tokens=False)["input_ids"] != tok(text, add_special_tokens=False)["input_ids"]:
            raise RuntimeError(f"{out}: the saved tokenizer reloads as {type(again).__name__} and tokenizes "
                               "differently from the one used for the warm-up")


def tiny_lm(tok, model: TinyModelSpec, moe: TinyMoeSpec | None):
    """A freshly initialised tiny causal LM for the tokenizer (seed torch first): Qwen2, or Qwen3-MoE."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=64 * ((len(tok) + 63) // 64), hidden_size=model.hidden_size,
                  num_hidden_layers=model.num_hidden_layers, num_attention_heads=model.num_attention_heads,
                  num_key_value_heads=model.num_key_value_heads, intermediate_size=model.intermediate_size,
                  max_position_embeddings=model.max_position_embeddings, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, rope_theta=10000.0,
                  dtype="float32")
    if moe is None:
        return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    # Untied like every released Qwen3-MoE (and the trainer's MoE logit tests); intermediate_size is unused with
    # every layer sparse but the config reader requires it.
    cfg = Qwen3MoeConfig(**common, head_dim=model.hidden_size // model.num_attention_heads,
                         num_experts=moe.num_experts, num_experts_per_tok=moe.num_experts_per_tok,
                         moe_intermediate_size=moe.moe_intermediate_size, norm_topk_prob=True,
                         router_aux_loss_coef=moe.router_aux_loss_coef, decoder_sparse_step=1, mlp_only_layers=[],
                         tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(cfg)


def warmup_loss(lm, ids, att, lab, moe: TinyMoeSpec | None):
    """The supervised loss. A Qwen3-MoE adds router_aux_loss_coef x its load-balancing loss only when asked for
    the router logits: asked, because the warm-up trains the routers from random and, unbalanced, could leave
    one expert (one EP rank) with most tokens, which would make the EP demo a lopsided one."""
    if moe is None:
        return lm(input_ids=ids, attention_mask=att, labels=lab).loss
    return lm(input_ids=ids, attention_mask=att, labels=lab, output_router_logits=True).loss


def check_split_sizes(spec: SumSpec, n_eval: int, n_calibration: int, n_train: int, disjoint_train: bool,
                      batch_size: int) -> None:
    """Refuse split sizes the spec's problem space cannot hold, naming the builder's flags and the fix."""
    sizes = {"n_eval (--n-eval)": n_eval, "n_calibration (--n-calibration)": n_calibration,
             "n_train (--n-train)": n_train}
    for name, n in sizes.items():
        if n < 1:
            raise ValueError(f"{name} must be at least 1, got {n}")
    used = n_eval + n_calibration + n_train
    split = f"n_eval {n_eval} + n_calibration {n_calibration} + n_train {n_train} = {used}"
    if not disjoint_train and used > spec.space:
        raise ValueError(f"{split} distinct problems, but the spec has only {spec.space:,}; lower --n-train, "
                         "--n-eval or --n-calibration")
    if disjoint_train and spec.space - used < batch_size:
        room = spec.space - n_eval - n_calibration - batch_size
        fix = (f"lower --n-train to at most {room} (or --n-eval / --n-calibration)" if room >= 1
               else "lower --n-eval or --n-calibration")
        raise ValueError(f"with --disjoint-train the warm-up draws from the problems left after eval, calibration "
                         f"and train: {split} leaves {spec.space - used} of the spec's {spec.space:,}, fewer than "
                         f"one warm-up batch ({batch_size}); {fix}, or drop --disjoint-train")


SPLITS = ("eval", "calibration", "train", "warmup")


def task_splits(seed: int, spec: SumSpec, n_eval: int, n_calibration: int, n_train: int, max_warmup: int,
                disjoint_train: bool = False, uniform_splits: bool = False) -> dict[str, list[dict]]:
    """The task's problems by split (SPLITS), before the chat template. Eval and calibration are held out
    from everything; the warm-up (up to ``max_warmup`` problems) shares problems with RL train unless
    ``disjoint_train``, which gives it only problems outside the other three (RL then trains on problems the
    warm-up never saw). The draws of eval, calibration and train do not depend on ``disjoint_train``.

    By default each split is drawn by make_problem (term count first), so eval, drawn first, takes most of the
    100 two-term sums and a disjoint warm-up gets none. ``uniform_splits`` instead cuts consecutive slices of
    the whole problem space in a seeded random order: every split then has the space's mix of term counts."""
    if uniform_splits:
        return _uniform_splits(seed, spec, (n_eval, n_calibration, n_train), max_warmup, disjoint_train)
    eval_rows = generate_problems(n_eval, seed, spec, split="eval")
    held_out = {r["problem"] for r in eval_rows}
    calib_rows = generate_problems(n_calibration, seed, spec, exclude=held_out, split="calibration")
    held_out |= {r["problem"] for r in calib_rows}
    train_rows = generate_problems(n_train, seed, spec, exclude=held_out, split="train")
    warm_excluded = held_out | {r["problem"] for r in train_rows} if disjoint_train else held_out
    n_warm = min(max_warmup, spec.space - len(warm_excluded))
    warm_rows = generate_problems(n_warm, seed, spec, exclude=warm_excluded, split="warmup")
    return dict(zip(SPLITS, (eval_rows, calib_rows, train_rows, warm_rows)))


def _uniform_splits(seed: int, spec: SumSpec, sizes: tuple[int, int, int], max_warmup: int,
                    disjoint_train: bool) -> dict[str, list[dict]]:
    if spec.space > 10**6:
        raise ValueError(f"uniform_splits (--uniform-splits) enumerates the spec's {spec.space:,} problems; use a "
                         "spec with at most 1,000,000 or drop the option")
    space = shuffled_space(seed, spec)
    cuts = [0, *itertools.accumulate(sizes)]
    held = [space[a:b] for a, b in zip(cuts, cuts[1:])]
    # not disjoint: the warm-up draws from everything but eval and calibration, train included
    pool = space[cuts[-1]:] if disjoint_train else space[cuts[2]:]
    if not disjoint_train:
        random.Random(f"{seed}/warmup").shuffle(pool)  # so that train is not simply the warm-up's first slice
    out = dict(zip(SPLITS, [*held, pool[:max_warmup]]))
    return {k: [as_row(p, k, i) for i, p in enumerate(rows)] for k, rows in out.items()}


def build_tiny_task(out_dir: str | Path, seed: int = 0, *, n_train: int = 512, n_eval: int = 128,
                    spec: SumSpec = DEFAULT_SPEC, model: TinyModelSpec = TinyModelSpec(),
                    target_accuracy: float = 0.25, max_warmup_steps: int = 600, check_every: int = 20,
                    n_calibration: int = 128, batch_size: int = 32, lr: float = 3e-3,
                    disjoint_train: bool = False, uniform_splits: bool = False, moe: TinyMoeSpec | None = None,
                    log=print) -> TinyTaskPaths:
    """Write tokenizer, a warmed-up tiny Qwen2 (or Qwen3-MoE with ``moe``; safetensors), train/eval JSONL and
    build_info.json to ``out_dir``; return their paths. Eval and calibration problems are disjoint from each other and
    from the warm-up and train problems. The warm-up may see the RL train problems unless
    ``disjoint_train``, which draws the warm-up from the problems left after eval, calibration and train;
    ``uniform_splits`` gives every split the same mix of 2- and 3-term sums (see task_splits)."""
    import torch

    from .tiny_tokenizer import build_tiny_tokenizer

    if not 0 < target_accuracy < 1:
        raise ValueError(f"target_accuracy must be in (0, 1), got {target_accuracy}")
    if check_every < 1:
        raise ValueError(f"check_every (--check-every) must be at least 1, got {check_every}")
    check_split_sizes(spec, n_eval, n_calibration, n_train, disjoint_train, batch_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # determinism across machines, and fairness on a shared one
    try:
        tok = build_tiny_tokenizer()
        splits = task_splits(seed, spec, n_eval, n_calibration, n_train,
                             min(max_warmup_steps * batch_size, 20000), disjoint_train, uniform_splits)
        eval_rows, calib_rows, train_rows, warm_rows = (splits[k] for k in SPLITS)
        for rows in (eval_rows, train_rows, calib_rows, warm_rows):
            for r in rows:  # the training format's prompt is the final text fed to the tokenizer
                r["prompt"] = chat_prompt(tok, r["prompt"])
                r["chat_template"] = True  # a run must not wrap it again (data.apply_chat_template)

        torch.manual_seed(seed)
        lm = tiny_lm(tok, model, moe)
        opt = torch.optim.AdamW(lm.parameters(), lr=lr, weight_decay=0.0)

        def batch(rows):
            seqs, labels = [], []
            for r in rows:
                p = tok(r["prompt"], add_special_tokens=False)["input_ids"]
                s = tok(r["solution"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                seqs.append(p + s)
                labels.append([-100] * len(p) + s)  # learn the response only
            return pad_batch(seqs, labels, tok.pad_token_id)

        order = random.Random(f"{seed}/order").sample(range(len(warm_rows)), len(warm_rows))
        history, step, acc = [], 0, 0.0
        while step < max_warmup_steps:
            lm.train()
            idx = [order[(step * batch_size + j) % len(order)] for j in range(batch_size)]
            ids, lab, att = batch([warm_rows[i] for i in idx])
            loss = warmup_loss(lm, ids, att, lab, moe)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
            opt.step()
            step += 1
            if step % check_every == 0:
                acc = sampled_accuracy(lm, tok, calib_rows, seed=seed + step)
                history.append({"step": step, "loss": round(loss.item(), 4), "calibration_accuracy": acc})
                log(f"warm-up step {step}: loss {loss.item():.3f}, sampled accuracy {acc:.3f}")
                if acc >= target_accuracy:
                    break
        eval_acc = sampled_accuracy(lm, tok, eval_rows, seed=seed + 10**6)
        log(f"warm-up done after {step} steps: held-out sampled accuracy {eval_acc:.3f}")

        save_task(out, lm, tok, train_rows, eval_rows, max_new_tokens=32)
        info = {"seed": seed, "spec": asdict(spec), "model": asdict(model), "warmup_steps": step,
                "target_accuracy": target_accuracy, "check_every": check_every, "eval_sampled_accuracy": eval_acc,
                "history": history, "n_train": n_train, "n_eval": n_eval, "n_calibration": n_calibration,
                "disjoint_train": disjoint_train, "uniform_splits": uniform_splits,
                "n_warmup_problems": len(warm_rows),
                "build_seconds": round(time.monotonic() - t_start, 1),
                "parameters": sum(p.numel() for p in lm.parameters())}
        if moe is not None:  # only then: a dense build's build_info.json keeps its keys
            info["moe"] = asdict(moe)
        (out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    finally:
        torch.set_num_threads(threads)
    return TinyTaskPaths(str(out), str(out / TRAIN_FILE), str(out / EVAL_FILE), str(out / INFO_FILE))
