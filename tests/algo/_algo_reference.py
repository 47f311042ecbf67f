"""A literal, loop-based Algorithm 1 for the algo tests (exact rational arithmetic, no vectorisation), written
from the paper's pseudo-code. The released code's variant is tested against the released function itself
(_released_m2po.py, test_released_oracle.py), not against a transcription."""

from fractions import Fraction


def in_trust_region(lr: float, a: float, valid: bool) -> bool:
    return bool(valid) and ((a > 0 and lr > 0) or (a < 0 and lr < 0))


def greedy_remove(lrs, advs, valid, tau):
    """Algorithm 1 as written: while mean (log r)^2 over the remaining T > tau, drop the largest.
    Ties: the later token is dropped first. Returns keep flags (valid and not dropped)."""
    remaining = [i for i in range(len(lrs)) if in_trust_region(lrs[i], advs[i], valid[i])]
    v = {i: Fraction(lrs[i]) ** 2 for i in remaining}
    t = Fraction(tau)
    dropped = set()
    while remaining and sum(v[i] for i in remaining) > t * len(remaining):
        worst = max(remaining, key=lambda i: (v[i], i))
        remaining.remove(worst)
        dropped.add(worst)
    return [bool(valid[i]) and i not in dropped for i in range(len(lrs))]
