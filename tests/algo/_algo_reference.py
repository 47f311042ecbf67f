"""Literal, loop-based references for the algo tests (exact rational arithmetic, no vectorisation)."""

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


def released_cap_drop(lrs, advs, valid, tau):
    """The released code's capped bound (a transcription of its loop over sorted breakpoints, in Python
    floats) and the resulting zero-gradient set: T tokens with (log r)^2 > c^2."""
    T = [i for i in range(len(lrs)) if in_trust_region(lrs[i], advs[i], valid[i])]
    if not T:
        return [False] * len(lrs)
    d2 = sorted(float(lrs[i]) ** 2 for i in T)
    n = len(d2)
    total = sum(d2)
    target = tau * n
    if total / n <= tau + 1e-12 or target >= total - 1e-12:
        return [False] * len(lrs)
    if target <= 1e-12:
        c2 = 0.0
    else:
        c2 = None
        csum = 0.0
        for k in range(n):
            csum += d2[k]
            if d2[k] * (n - k - 1) + csum >= target - 1e-12:
                c2 = 0.0 if k == 0 else d2[k - 1] - 1e-12
                break
    drop = [False] * len(lrs)
    for i in T:
        drop[i] = float(lrs[i]) ** 2 > c2
    return drop
