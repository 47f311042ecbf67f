"""The eval generation callable over the rollout engines (SGLang servers or the CPU server), via
:class:`m2po_megatron.rollout.client.SyncRolloutClient`."""

from __future__ import annotations

from collections import Counter

from .benchmarks import GenerateFn

CALL_STRIDE = 2**40  # seeds per call: prompt i of a call starts at i * n, so calls never overlap whatever n is
MAX_CALLS = 2**20  # with seed < 2**62 (eval_seed) every request seed stays below 2**63, SGLang's int64 limit


def request_seed(seed: int, call: int, i: int, n: int) -> int:
    """SGLang's ``sampling_seed`` for prompt ``i`` of call ``call`` (the client gives sample j of it + j):
    distinct for every (call, i, j) of one ``seed``, whatever n each call asks for."""
    if not (0 <= call < MAX_CALLS and 0 <= i and (i + 1) * n <= CALL_STRIDE):
        raise ValueError(f"eval call {call}, prompt {i}, n={n}: beyond the seed layout ({MAX_CALLS} calls of at "
                         f"most {CALL_STRIDE} samples); evaluate fewer prompts per call")
    return seed + call * CALL_STRIDE + i * n


def rollout_generate_fn(client, seed: int | None = 0, timeout_s: float | None = 3600.0,
                        versions: Counter | None = None) -> GenerateFn:
    """Send every (prompt, n) to ``client`` (a SyncRolloutClient) concurrently and wait. With ``seed``,
    prompt i of call c uses ``request_seed(seed, c, i, n)`` (sample j adds j); the calls count from 0 for
    each callable, so one made again with the same seed repeats the same seeds. ``versions`` counts the
    weight version each answer came from."""
    calls = [0]

    def generate(prompts: list[list[int]], n: int, temperature: float, top_p: float,
                 max_new_tokens: int) -> list[list[list[int]]]:
        base = {"temperature": float(temperature), "top_p": float(top_p), "max_new_tokens": int(max_new_tokens)}
        futs = []
        for i, p in enumerate(prompts):
            sp = dict(base)
            if seed is not None:
                sp["sampling_seed"] = request_seed(seed, calls[0], i, n)
            futs.append(client.submit(p, sp, n=n, return_logprob=False))
        calls[0] += 1
        results = [f.result(timeout_s) for f in futs]
        if versions is not None:
            versions.update(s.weight_version for res in results for s in res)
        return [[list(s.output_ids) for s in res] for res in results]

    return generate
