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


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


# 64-bit finalizer (MurmurHash3's fmix64) in torch int64 arithmetic, which wraps on overflow; a logical right
# shift is an arithmetic one with the sign bits masked off.
_M1, _M2 = _signed(0xFF51AFD7ED558CCD), _signed(0xC4CEB9FE1A85EC53)
_GOLDEN = _signed(0x9E3779B97F4A7C15)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)


def _fmix64(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shr(x, 33)
    x = x * _M1
    x = x ^ _shr(x, 33)
    x = x * _M2
    return x ^ _shr(x, 33)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float64 uniforms in (0, 1), a pure function of (seed, position, token id): a counter-based
    generator, so that one call serves a whole batch and a sample depends only on its own request's seed and
    position (as SGLang's deterministic sampler, which hashes the same three)."""
    row = _fmix64(seeds.to(torch.int64) * _GOLDEN ^ _fmix64(positions.to(torch.int64) + 1))
    h = _fmix64(row[:, None] ^ (torch.arange(vocab, dtype=torch.int64) * _GOLDEN)[None, :])
    return (_shr(h, 11).to(torch.float64) + 0.5) / float(1 << 53)


def sample_rows(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per row by the Gumbel-max trick, argmax(log p + Gumbel noise): an exact draw from each row
    of `probs`, with the noise of (seed, position) from uniform_noise. Zero-probability tokens are never
    drawn."""
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, positions, probs.shape[-1])))
    return (probs.double().log() + gumbel).argmax(-1)
