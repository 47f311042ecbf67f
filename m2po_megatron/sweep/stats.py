"""The statistics of `m2po report`, as pure functions of numbers: a run's score (the mean of its last k
evaluations after step 0), a Student-t confidence interval for a mean over seeds, Welch's unequal-variance
t-test with the Welch-Satterthwaite degrees of freedom, a one-sample t-test, and the collapse rule.

scipy is imported lazily (only the t distribution is needed), so reading this module costs nothing. Every
function that cannot answer (fewer than 2 values in a group, no spread at all) returns a result whose
`reason` says why instead of raising: a report of a half-finished sweep must still print.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

LEVEL = 0.95  # every interval in the report is a 95 % one
SCORE_EVALS = 3  # the score averages a run's last 3 evaluations
# A run collapses if its score falls below its step-0 accuracy, or more than this many points (pass@1 %)
# below its own best evaluation.
COLLAPSE_DROP = 10.0


def t_quantile(q: float, dof: float) -> float:
    """The q-quantile of Student's t with `dof` (possibly fractional) degrees of freedom."""
    from scipy.stats import t

    return float(t.ppf(q, dof))


def t_sf(x: float, dof: float) -> float:
    """P(T > x) for Student's t with `dof` degrees of freedom."""
    from scipy.stats import t

    return float(t.sf(x, dof))


@dataclass(frozen=True)
class Interval:
    """A mean over n values with its 95 % Student-t interval (n - 1 dof); half = lo = hi = nan for n < 2."""
    n: int
    mean: float
    std: float
    half: float

    @property
    def lo(self) -> float:
        return self.mean - self.half

    @property
    def hi(self) -> float:
        return self.mean + self.half


def mean_ci(values: Sequence[float], level: float = LEVEL) -> Interval:
    n = len(values)
    if n == 0:
        return Interval(0, math.nan, math.nan, math.nan)
    mean = statistics.fmean(values)
    if n < 2:
        return Interval(1, mean, math.nan, math.nan)
    std = statistics.stdev(values)
    return Interval(n, mean, std, t_quantile(0.5 + level / 2, n - 1) * std / math.sqrt(n))


@dataclass(frozen=True)
class TTest:
    """A difference of means (or a mean, for the one-sample test) with its 95 % interval and p-values;
    when the test cannot be made, every number is nan and `reason` says why."""
    diff: float
    lo: float
    hi: float
    dof: float
    t: float
    p: float  # two-sided
    reason: str = ""

    @property
    def ok(self) -> bool:
        return not self.reason

    @property
    def p_below(self) -> float:
        """One-sided p-value for 'the difference is below 0' (the same t statistic, one tail)."""
        return t_sf(-self.t, self.dof) if self.ok else math.nan

    @property
    def p_above(self) -> float:
        return t_sf(self.t, self.dof) if self.ok else math.nan


def no_test(reason: str, diff: float = math.nan) -> TTest:
    """A TTest that was not made, saying why."""
    return TTest(diff, math.nan, math.nan, math.nan, math.nan, math.nan, reason)


def _from_t(diff: float, se: float, dof: float, level: float) -> TTest:
    t = diff / se
    half = t_quantile(0.5 + level / 2, dof) * se
    return TTest(diff, diff - half, diff + half, dof, t, min(1.0, 2 * t_sf(abs(t), dof)))


def welch(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> TTest:
    """Welch's t-test of mean(a) - mean(b): se = sqrt(va/na + vb/nb), dof by Welch-Satterthwaite. The same
    statistic and p-value as scipy.stats.ttest_ind(a, b, equal_var=False), with the interval added."""
    na, nb = len(a), len(b)
    if na < 2 or nb < 2:
        diff = statistics.fmean(a) - statistics.fmean(b) if na and nb else math.nan
        which = " and ".join(f"{name} has n={n}" for name, n in (("the group", na), ("the reference", nb)) if n < 2)
        return no_test(f"{which}; a test needs n >= 2 in both", diff)
    va, vb = statistics.variance(a), statistics.variance(b)
    diff = statistics.fmean(a) - statistics.fmean(b)
    wa, wb = va / na, vb / nb
    if wa + wb == 0:
        return no_test("both groups have zero spread; no t-test", diff)
    dof = (wa + wb) ** 2 / (wa ** 2 / (na - 1) + wb ** 2 / (nb - 1))
    return _from_t(diff, math.sqrt(wa + wb), dof, level)


def one_sample(values: Sequence[float], level: float = LEVEL) -> TTest:
    """t-test of mean(values) against 0 (n - 1 dof), e.g. of paired differences."""
    n = len(values)
    if n < 2:
        return no_test(f"n={n}; a test needs n >= 2", statistics.fmean(values) if n else math.nan)
    sd = statistics.stdev(values)
    mean = statistics.fmean(values)
    if sd == 0:
        return no_test("zero spread; no t-test", mean)
    return _from_t(mean, sd / math.sqrt(n), n - 1, level)


def score_steps(evals: dict[int, dict[str, float]], k: int = SCORE_EVALS) -> list[int]:
    """The steps of a run's last k evaluations after step 0 that have a benchmark average (fewer if it has
    fewer; none if it was only evaluated at step 0: the starting model is not a result)."""
    return sorted(s for s in evals if s > 0 and "avg" in evals[s])[-k:]


def score(evals: dict[int, dict[str, float]], k: int = SCORE_EVALS) -> tuple[dict[str, float], int]:
    """({benchmark: mean over the score steps that have it}, number of score steps)."""
    steps = score_steps(evals, k)
    names = {b for s in steps for b in evals[s]}
    return {b: statistics.fmean([evals[s][b] for s in steps if b in evals[s]]) for b in names}, len(steps)


def collapsed(score_avg: float, start: Optional[float], best: float, drop: float = COLLAPSE_DROP) -> bool:
    """The collapse rule: the score is below the step-0 accuracy (when known), or more than `drop` points
    below the run's own best evaluation."""
    return (start is not None and score_avg < start) or score_avg < best - drop
