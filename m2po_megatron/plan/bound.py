"""An upper bound on the trained tokens per second a layout can reach in the simulation (plan/sim.py), so
that the search prunes only layouts it has shown to be worse.

Every term is a lower bound on time that the simulated loop cannot avoid:
- **Generation.** A sample of prompt p and response L occupies its server for its prefill (p x
  prefill_per_token_s, which stalls decoding) and takes part in L decode steps, holding p + j KV tokens at its
  j-th. The servers' decode steps of a run together cost at least Costs.decode_lb(sum L, sum KV, sum L / B),
  B the most sequences a server runs at once, and S servers work in parallel. Paused servers (a weight push)
  do nothing. A synchronous step also waits for its longest response, which needs its own L decode steps one
  after another.
- **Training.** The trainer trains each step's tokens (Costs.train_s), pushes the weights and does the
  loop's own work, one after the other.
`bounded` overlaps generation with training, so its step takes at least the larger of the two; the synchronous
modes (on_policy, fixed_lag) generate, then train, so at least their sum.

The bound is on a run at the *expected* response lengths (mean, and mean of L (L - 1) / 2, from a fixed
sample of the length distribution). A simulated run draws its own lengths, so its throughput can exceed the
bound by the sampling error of its mean length; `margin` is that error (three standard errors), and the search
prunes a layout only when its bound, raised by the margin, is below a simulated one. tests/plan/test_bound.py
checks the bound against simulations."""
from __future__ import annotations

import functools
import math
import random

from m2po_megatron.plan.costs import Costs
from m2po_megatron.plan.sim import LengthDist, SimSpec

__all__ = ["Moments", "margin", "moments", "upper_bound"]

_DRAWS = 100_000


class Moments(tuple):
    """(mean L, mean L (L - 1) / 2, the length the longest of a step's responses reaches with probability
    0.999) of a LengthDist, for `per_step` samples per step."""

    @property
    def mean(self) -> float:
        return self[0]

    @property
    def tri(self) -> float:
        return self[1]

    @property
    def longest(self) -> int:
        return self[2]


@functools.lru_cache(maxsize=256)
def moments(dist: LengthDist, per_step: int) -> Moments:
    rng = random.Random(12345)
    draws = sorted(dist.sample(rng) for _ in range(_DRAWS))
    mean = sum(draws) / _DRAWS
    tri = sum(x * (x - 1) / 2 for x in draws) / _DRAWS
    # the longest of per_step draws is below q with probability F(q)^per_step; take the q where that is 0.001,
    # lowered by three standard errors of the empirical quantile
    level = 0.001 ** (1 / max(per_step, 1))
    level -= 3 * math.sqrt(level * (1 - level) / _DRAWS)
    longest = draws[max(0, min(_DRAWS - 1, int(level * _DRAWS)))] if level > 0 else draws[0]
    return Moments((mean, tri, longest))


def margin(spec: SimSpec, measured_steps: int, seeds: int) -> float:
    """The relative amount by which a simulation's mean throughput may exceed the bound by chance: three
    standard errors of the mean response length over the samples a plan measures, plus 1 % for the fixed
    sample behind `moments`."""
    samples = max(1, spec.groups_per_step * spec.n * measured_steps * seeds)
    return 0.01 + 3 * spec.response.cv / math.sqrt(samples)


def _syncs_per_step(spec: SimSpec, measured_steps: int) -> float:
    if spec.mode != "bounded":
        return 1.0  # the synchronous modes push the weights after every step
    interval = spec.sync_interval or spec.updates_per_step
    # whole pushes within the measured steps, whatever phase they start at
    return math.floor(measured_steps * spec.updates_per_step / interval) / max(measured_steps, 1)


def upper_bound(spec: SimSpec, costs: Costs, measured_steps: int = 8) -> float:
    """Trained tokens per second no simulation of `spec` at `costs` exceeds, up to `margin` (see the module)."""
    m = moments(spec.response, spec.groups_per_step * spec.n)
    p, N, S = spec.prompt_len, spec.groups_per_step * spec.n, max(spec.num_servers, 1)
    B = max(1, min(costs.max_running, spec.max_concurrency))
    tokens = N * (p + m.mean)
    # server-seconds of one sample: its share of the decode steps, and its prefill
    per_sample = costs.decode_lb(m.mean, p * m.mean + m.tri, m.mean / B) + p * costs.prefill_per_token_s
    syncs = _syncs_per_step(spec, measured_steps) * costs.sync_s()
    gen = N * per_sample / S
    train = costs.train_s(tokens, spec.updates_per_step, spec.logprob_pass) + costs.loop_fixed_s + syncs
    if spec.mode == "bounded":
        step = max(train, gen + syncs)  # the servers are paused while the weights are pushed
    else:
        L = m.longest
        tail = costs.decode_lb(L, p * L + L * (L - 1) / 2, L) + p * costs.prefill_per_token_s
        recompute = tokens * costs.logprob_per_token_s if spec.recompute_behaviour else 0.0
        step = max(gen, tail) + recompute + train
    return tokens / step
