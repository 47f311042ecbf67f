"""Evaluation sampling seeds: every (run seed, step, call, prompt, sample) gets its own, inside SGLang's
int64 range, and the same arguments give the same seeds again (a resumed run evaluates as an uninterrupted one)."""

import pytest

from m2po_megatron.eval.in_run import eval_seed
from m2po_megatron.eval.rollout_generate import CALL_STRIDE, request_seed
from m2po_megatron.rollout import protocol
from m2po_megatron.rollout.client import build_generate_body, sample_seeds

PROMPT_BATCH = 64  # benchmarks.evaluate's default: 256 prompts arrive as 4 calls of 64


def _evaluation_seeds(run_seed, step, n_prompts=256, n=16):
    """The per-sample seeds of one evaluation, through the same functions the evaluator, the eval generate
    callable and the rollout client use, call by call as benchmarks.evaluate makes them."""
    base = eval_seed(run_seed, step)
    out = []
    for call, start in enumerate(range(0, n_prompts, PROMPT_BATCH)):
        for i in range(min(PROMPT_BATCH, n_prompts - start)):
            out += sample_seeds(request_seed(base, call, i, n), n)
    return out


def test_seeds_distinct_across_runs_steps_prompts_and_samples():
    runs, steps = range(1, 6), (0, 25, 50, 75, 100)
    seeds = [s for r in runs for t in steps for s in _evaluation_seeds(r, t)]
    assert len(seeds) == 5 * 5 * 256 * 16
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s <= 2**63 - 1 for s in seeds)
    # and SGLang's request check accepts the extremes
    for s in (min(seeds), max(seeds)):
        protocol.sampling_params(build_generate_body([1, 2], {"sampling_seed": s}, "r")["sampling_params"],
                                 tokenizer=False)
    # the old scheme (run.seed + 7919 * step, then (call * 2**20 + i) * n + j) shared most of them
    old = [r + 7919 * t + (c * 2**20 + i) * 16 + j for r in runs for t in steps
           for c in range(4) for i in range(64) for j in range(16)]
    assert len(set(old)) < 0.3 * len(old)


def test_same_arguments_same_seeds():
    assert _evaluation_seeds(2, 50) == _evaluation_seeds(2, 50)


def test_calls_with_different_n_do_not_overlap():
    base = eval_seed(1, 0)
    a = {s for i in range(64) for s in sample_seeds(request_seed(base, 0, i, 16), 16)}
    b = {s for i in range(64) for s in sample_seeds(request_seed(base, 1, i, 4), 4)}
    assert not a & b and len(a) == 64 * 16 and len(b) == 64 * 4


def test_seed_layout_limits_are_refused():
    with pytest.raises(ValueError, match="fewer prompts per call"):
        request_seed(0, 0, CALL_STRIDE // 16, 16)
    with pytest.raises(ValueError, match="calls"):
        request_seed(0, 2**20, 0, 16)
