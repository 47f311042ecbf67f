"""Pure sampling math of the CPU server (no I/O, no threads), following SGLang's sampler semantics.

Log-probs returned to the client (SGLang's default, i.e. SGLANG_RETURN_ORIGINAL_LOGPROB unset):
    temperature > 0:  log_softmax(logits / temperature)   -- BEFORE top-k / top-p / min-p filtering
    temperature == 0: log_softmax(logits)                 -- greedy
Tokens are drawn from the filtered, renormalised distribution q. So with top_p=1, top_k=-1, min_p=0 the
returned log-prob is exactly the log-prob of the distribution sampled from; with a filter it is the
log-prob under the temperature-scaled distribution p (q = p / p(kept set) on the kept set). The trainer's
importance ratios then use p, which is what SGLang reports too."""
from __future__ import annotations

import torch

GREEDY_EPS = 1e-6  # SGLang treats temperatures below this as greedy


def returned_logprobs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """[B, V] log-probs that the server reports (see module doc). `temperature` is [B]."""
    t = torch.where(temperature < GREEDY_EPS, torch.ones_like(temperature), temperature)
    return torch.log_softmax(logits.float() / t[:, None], dim=-1)


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                   top_k: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """[B, V] probabilities actually sampled from: softmax(logits / T), then top-k (k=-1: all), top-p
    (smallest prefix of the sorted distribution whose mass reaches top_p; the best token is always kept),
    min-p (keep p >= min_p * max p), renormalised. Greedy rows become one-hot on the argmax."""
    t = torch.where(temperature < GREEDY_EPS, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits.float() / t[:, None], dim=-1)
    vocab = probs.shape[-1]
    sorted_p, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).expand_as(sorted_p)
    k = torch.where(top_k < 1, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
    keep = ranks < k[:, None]
    mass_before = sorted_p.cumsum(-1) - sorted_p
    keep &= mass_before < top_p[:, None]
    keep &= sorted_p >= min_p[:, None] * sorted_p[:, :1]
    keep[:, 0] = True
    kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    out = torch.zeros_like(probs).scatter_(-1, order, kept)
    out = out / out.sum(-1, keepdim=True)
    greedy = temperature < GREEDY_EPS
    if greedy.any():
        onehot = torch.zeros_like(out).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        out = torch.where(greedy[:, None], onehot, out)
    return out


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row, each row from its own generator (per-request sampling_seed reproducibility)."""
    return torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(generators)])
