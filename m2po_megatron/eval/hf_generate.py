"""A generation callable over a Hugging Face causal LM (``model.generate``), in the signature the eval core
and the training loop share: ``generate_fn(prompts, n, temperature, top_p, max_new_tokens)`` ->
for each prompt, ``n`` lists of output token ids (ending with EOS when one was produced)."""

from __future__ import annotations

from typing import Callable

GenerateFn = Callable[[list[list[int]], int, float, float, int], list[list[list[int]]]]


def hf_generate_fn(model, pad_token_id: int, eos_token_id: int | list[int], batch_size: int = 64,
                   seed: int | None = 0) -> GenerateFn:
    """Wrap ``model`` (a ``transformers`` causal LM). Sampling is reproducible: call k reseeds torch with
    ``seed + k`` (``seed=None`` leaves the global RNG alone). ``temperature == 0`` means greedy."""
    import torch

    eos_ids = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    calls = [0]

    @torch.no_grad()
    def generate(prompts: list[list[int]], n: int, temperature: float, top_p: float,
                 max_new_tokens: int) -> list[list[list[int]]]:
        if n < 1 or max_new_tokens < 1:
            raise ValueError(f"n and max_new_tokens must be >= 1, got n={n}, max_new_tokens={max_new_tokens}")
        if seed is not None:
            torch.manual_seed(seed + calls[0])
        calls[0] += 1
        device = next(model.parameters()).device
        flat = [p for p in prompts for _ in range(n)]
        outs: list[list[int]] = []
        model.eval()
        for b in range(0, len(flat), batch_size):
            chunk = flat[b : b + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, p in enumerate(chunk):  # left padding: every prompt ends where generation starts
                ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
                mask[i, width - len(p) :] = 1
            kwargs = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 \
                else dict(do_sample=False)
            gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=max_new_tokens, pad_token_id=pad_token_id,
                                 eos_token_id=sorted(eos_ids), **kwargs)
            for row in gen[:, width:].tolist():
                out = []
                for t in row:
                    out.append(t)
                    if t in eos_ids:
                        break
                outs.append(out)
        return [outs[i * n : (i + 1) * n] for i in range(len(prompts))]

    return generate
