"""The tests and verdicts of `m2po report`: each stale group's score against on-policy GRPO and against
stale GRPO at the same staleness (Welch's t-test, sweep/stats.py), and the "Claims" section that reads them:
is stale M2PO within noise of on-policy GRPO, is stale GRPO below it, does GRPO without trust region collapse.

Groups are duck-typed (sweep/report.py's Group: model, method, staleness, variant, label, runs, score,
context), so this module imports nothing of the report. A reference is the GRPO group of the same model at
staleness 0 (on-policy) or at the group's own staleness (stale), and of the same `context`: the run config
apart from seeds, names, paths, algo.* and staleness.*; so an M2PO tau variant is compared with the one
GRPO group its sweep ran beside it.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

from m2po_megatron.sweep import stats

REFS = {"onpolicy": "on-policy GRPO", "stale_grpo": "stale GRPO, same s"}
ALPHA = 0.05


@dataclass
class Comparison:
    ref: Any  # the reference Group, or None when there is none
    tests: dict[str, stats.TTest] = field(default_factory=dict)  # benchmark -> Welch test of the score
    note: str = ""  # why there is no test, or how the reference differs

    def test(self, bench: str = "avg") -> stats.TTest:
        if bench in self.tests:
            return self.tests[bench]
        return stats.no_test(self.note or f"no {bench} score in the group or the reference")


def _describe_diff(a: dict, b: dict, limit: int = 3) -> str:
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    text = "; ".join(f"{k}: {a.get(k, '(unset)')} here, {b.get(k, '(unset)')} there" for k in keys[:limit])
    return text + (f"; and {len(keys) - limit} more" if len(keys) > limit else "")


def reference(g, groups: list, staleness: str) -> tuple[Any, str]:
    """(the GRPO group of g's model at `staleness` and g's context, or None; a note)."""
    kind = "on-policy" if staleness == "0" else f"stale (s={staleness})"
    cands = [h for h in groups if h is not g and h.model == g.model and h.method == "grpo" and h.staleness == staleness]
    if not cands:
        return None, f"no {kind} GRPO runs of {g.model}"
    same = [h for h in cands if h.context == g.context]
    if len(same) == 1:
        return same[0], ""
    if len(same) > 1:
        return None, f"ambiguous: {len(same)} {kind} GRPO variants ({'; '.join(h.variant for h in same)})"
    if len(cands) == 1:
        return cands[0], f"the reference differs in {_describe_diff(g.context, cands[0].context)}"
    return None, f"none of the {len(cands)} {kind} GRPO groups has this group's config"


def compare(groups: list) -> dict[int, dict[str, Comparison]]:
    """id(group) -> {"onpolicy" | "stale_grpo": Comparison} for every stale group (staleness != 0); the
    stale GRPO group has no stale_grpo entry (it is that reference)."""
    out: dict[int, dict[str, Comparison]] = {}
    for g in groups:
        if g.staleness == "0":
            continue
        row = {}
        for key, s in (("onpolicy", "0"), ("stale_grpo", g.staleness)):
            if key == "stale_grpo" and g.method == "grpo":
                continue
            ref, note = reference(g, groups, s)
            c = Comparison(ref, note=note)
            if ref is not None:
                for b, cell in g.score.items():
                    if b in ref.score:
                        c.tests[b] = stats.welch(cell.values, ref.score[b].values)
            row[key] = c
        out[id(g)] = row
    return out


# ----------------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------------
def fmt_p(p: float) -> str:
    return "p < 0.001" if p < 0.001 else f"p = {p:.3f}"


def cell(c: Optional[Comparison]) -> str:
    """A Markdown table cell: 'Δ [lo, hi], p' or 'n/a (why)'."""
    if c is None:
        return "-"
    t = c.test("avg")
    if not t.ok:
        return f"n/a ({t.reason})"
    return f"{t.diff:+.1f} [{t.lo:+.1f}, {t.hi:+.1f}], {fmt_p(t.p)}" + (" *" if c.note else "")


def _delta(t: stats.TTest) -> str:
    return f"Δ = {t.diff:+.1f} points [95 % CI {t.lo:+.1f}, {t.hi:+.1f}], Welch {t.dof:.1f} dof"


def _name(g, multi_model: bool) -> str:
    return f"{g.label}" + (f" ({g.model})" if multi_model else "")


def _m2po_claim(g, comps: dict[str, Comparison], multi: bool) -> str:
    out = f"- **{_name(g, multi)} vs on-policy GRPO**: "
    t = comps["onpolicy"].test()
    if not t.ok:
        out += f"no verdict: {t.reason}."
    elif t.p >= ALPHA:
        out += (f"{_delta(t)}, {fmt_p(t.p)}: not significantly different at {ALPHA}, i.e. within noise; this is "
                f"not equivalence: the interval still admits a difference from {t.lo:+.1f} to {t.hi:+.1f} points.")
    else:
        out += (f"{_delta(t)}, {fmt_p(t.p)}: significantly {'below' if t.diff < 0 else 'above'} on-policy GRPO "
                f"at {ALPHA}; not within noise.")
    s = comps.get("stale_grpo")
    if s is not None:
        ts = s.test()
        out += (f" Against stale GRPO at s={g.staleness}: " + (f"{_delta(ts)}, {fmt_p(ts.p)}, one-sided "
                f"{fmt_p(ts.p_above)} for 'M2PO above'." if ts.ok else f"no test: {ts.reason}."))
    return out + (f" (Note: {comps['onpolicy'].note}.)" if comps["onpolicy"].note and t.ok else "")


def _stale_grpo_claim(g, comps: dict[str, Comparison], multi: bool) -> str:
    out = f"- **{_name(g, multi)} below on-policy GRPO?** "
    c = comps["onpolicy"]
    t = c.test()
    if not t.ok:
        return out + f"no verdict: {t.reason}."
    verdict = "yes, below" if t.p_below < ALPHA else "not shown below"
    return (out + f"{_delta(t)}; one-sided Welch test (alternative: stale < on-policy) {fmt_p(t.p_below)}: "
            f"{verdict} at {ALPHA} (two-sided {fmt_p(t.p)})." + (f" (Note: {c.note}.)" if c.note else ""))


def _collapse_claim(g, multi: bool) -> str:
    out = f"- **{_name(g, multi)} collapses?** "
    rows = []  # (score, start or None, best) per run with a score
    for r in g.runs:
        sc, n = stats.score(r.evals)
        trained = [row["avg"] for s, row in r.evals.items() if s > 0 and "avg" in row]
        if n and "avg" in sc and trained:
            rows.append((sc["avg"], r.evals.get(0, {}).get("avg"), max(trained)))
    if not rows:
        return out + "no verdict: no run has an evaluation after step 0."
    k = sum(stats.collapsed(sc, start, best) for sc, start, best in rows)
    verdict = ("yes, in every run" if k == len(rows) else "no run collapses" if k == 0
               else f"in {k} of {len(rows)} runs")
    f1 = (lambda xs: ", ".join("-" if x is None else f"{x:.1f}" for x in xs))
    out += (f"{verdict}, by the rule above (per run: score {f1(r[0] for r in rows)}; step 0 {f1(r[1] for r in rows)}; "
            f"best {f1(r[2] for r in rows)}).")
    drops = stats.mean_ci([sc - best for sc, _, best in rows])
    out += f" Score minus own best: {drops.mean:+.1f}" + (f" [95 % CI {drops.lo:+.1f}, {drops.hi:+.1f}]"
                                                           if drops.n > 1 else "") + "."
    vs_start = [sc - start for sc, start, _ in rows if start is not None]
    if vs_start:
        t = stats.one_sample(vs_start)
        out += " Score minus step-0 accuracy: " + (
            f"{t.diff:+.1f} [95 % CI {t.lo:+.1f}, {t.hi:+.1f}], one-sided {fmt_p(t.p_below)} for 'below the start'."
            if t.ok else f"{statistics.fmean(vs_start):+.1f} (no test: {t.reason}).")
    return out


def claims(groups: list, comps: dict[int, dict[str, Comparison]]) -> str:
    """The Markdown "Claims" section, or "" when no group it speaks of exists."""
    multi = len({g.model for g in groups}) > 1
    lines = []
    for g in groups:
        if g.method == "m2po" and id(g) in comps:
            lines.append(_m2po_claim(g, comps[id(g)], multi))
    for g in groups:
        if g.method == "grpo" and id(g) in comps:
            lines.append(_stale_grpo_claim(g, comps[id(g)], multi))
    notr = [g for g in groups if g.method == "grpo_notr"]
    for g in notr:
        lines.append(_collapse_claim(g, multi))
    if not lines:
        return ""
    head = ["## Claims\n",
            f"Read from the score (the mean of each run's last {stats.SCORE_EVALS} evaluations after step 0, "
            f"benchmark average, pass@1 %), by Welch's t-test at {ALPHA} (Δ: the group minus the reference). "
            f"A difference that is not significant is not shown to be zero; its 95 % CI says how large it "
            f"could still be."]
    if notr:
        head.append(f"A run **collapses** if its score falls below its step-0 accuracy or more than "
                    f"{stats.COLLAPSE_DROP:g} points below its own best evaluation.")
    return "\n".join(head) + "\n\n" + "\n".join(lines) + "\n"


def fmt_num(x: Optional[float]) -> str:
    """A CSV number: 6 significant digits, empty for None or NaN."""
    return "" if x is None or math.isnan(x) else f"{x:.6g}"


def csv_columns() -> list[str]:
    return [f"vs_{k}_{c}" for k in REFS for c in ("ref", "diff", "lo", "hi", "dof", "p", "p_below", "note")]


def csv_values(comps: Optional[dict[str, Comparison]], bench: str) -> list[str]:
    out: list[str] = []
    for k in REFS:
        c = (comps or {}).get(k)
        if c is None:
            out += [""] * 8
            continue
        t = c.test(bench)
        ref = c.ref.label if c.ref is not None else ""
        note = "; ".join(dict.fromkeys(x for x in (t.reason, c.note) if x))  # once when they are the same
        out += [ref, *map(fmt_num, (t.diff, t.lo, t.hi, t.dof, t.p, t.p_below)), note]
    return out
