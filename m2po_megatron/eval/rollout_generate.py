"""The eval generation callable over the rollout engines (SGLang servers or the CPU server), via
:class:`m2po_megatron.rollout.client.SyncRolloutClient`."""

from __future__ import annotations

from .benchmarks import GenerateFn


def rollout_generate_fn(client, seed: int | None = 0, timeout_s: float | None = 3600.0) -> GenerateFn:
    """Send every (prompt, n) to ``client`` (a SyncRolloutClient) concurrently and wait. With ``seed``,
    prompt i of call c uses SGLang's ``sampling_seed`` = seed + (c * 2**20 + i) * n (sample j adds j)."""
    calls = [0]

    def generate(prompts: list[list[int]], n: int, temperature: float, top_p: float,
                 max_new_tokens: int) -> list[list[list[int]]]:
        base = {"temperature": float(temperature), "top_p": float(top_p), "max_new_tokens": int(max_new_tokens)}
        futs = []
        for i, p in enumerate(prompts):
            sp = dict(base)
            if seed is not None:
                sp["sampling_seed"] = seed + (calls[0] * 2**20 + i) * n
            futs.append(client.submit(p, sp, n=n, return_logprob=False))
        calls[0] += 1
        return [[list(s.output_ids) for s in f.result(timeout_s)] for f in futs]

    return generate
