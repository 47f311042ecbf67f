"""The CPU server's counter-based sampler: exact draws from the filtered distribution, a pure function of
(seed, position), so a batch is one call and a request's samples do not depend on what runs beside it."""
import math

import torch

from m2po_megatron.rollout import sampling


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    n = 40_000
    toks = sampling.sample_rows(probs.expand(n, -1), torch.arange(n), torch.full((n,), 7))
    freq = torch.bincount(toks, minlength=5).double() / n
    assert freq[4] == 0  # a zero-probability token is never drawn
    for f, p in zip(freq[:4].tolist(), probs[:4].tolist()):
        assert abs(f - p) < 5 * math.sqrt(p * (1 - p) / n)  # 5 sigma
    # the same along positions of one seed: the position term decorrelates the steps of one request
    toks = sampling.sample_rows(probs.expand(n, -1), torch.full((n,), 3), torch.arange(n))
    freq = torch.bincount(toks, minlength=5).double() / n
    assert all(abs(f - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-12 for f, p in zip(freq.tolist(), probs.tolist()))


def test_a_row_depends_only_on_its_seed_and_position():
    probs = torch.softmax(torch.randn(6, 50, generator=torch.Generator().manual_seed(0)), -1)
    seeds, pos = torch.tensor([1, 2, 3, 2**62 + 5, 0, 9]), torch.tensor([0, 5, 5, 40, 1, 2])
    alone = torch.stack([sampling.sample_rows(probs[i:i + 1], seeds[i:i + 1], pos[i:i + 1])[0] for i in range(6)])
    assert torch.equal(sampling.sample_rows(probs, seeds, pos), alone)
    perm = torch.tensor([5, 3, 1, 0, 2, 4])
    assert torch.equal(sampling.sample_rows(probs[perm], seeds[perm], pos[perm]), alone[perm])


def test_noise_is_uniform_and_differs_across_seeds_positions_and_tokens():
    u = sampling.uniform_noise(torch.arange(64), torch.zeros(64, dtype=torch.long), 256)
    assert u.dtype == torch.float64 and 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert len(set(u.flatten().tolist())) == u.numel()  # no repeats across seeds and token ids
    v = sampling.uniform_noise(torch.arange(64), torch.ones(64, dtype=torch.long), 256)
    assert not torch.isclose(u, v).any()
    # adjacent seeds are not correlated (a weak hash would make seed s and s + 1 move together)
    a = sampling.uniform_noise(torch.arange(0, 4000, 2), torch.zeros(2000, dtype=torch.long), 1)[:, 0]
    b = sampling.uniform_noise(torch.arange(1, 4000, 2), torch.zeros(2000, dtype=torch.long), 1)[:, 0]
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.1
