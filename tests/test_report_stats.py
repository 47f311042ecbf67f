"""The statistics of m2po report against values worked by hand: the Student-t interval (t-table values), Welch's
t-test (a closed-form t CDF for 4 dof, and a numerically integrated t density for a fractional dof), the
last-3 score, the n < 2 path, the Claims text, the CSV columns and the CI bands of the plots."""
import csv
import math

import pytest
from scipy.stats import ttest_ind

from m2po_megatron.sweep import stats
from m2po_megatron.sweep.plot import ci_band, plot_groups
from m2po_megatron.sweep.report import find_runs, load_run, make_report, summarize
from test_report import make_run

T975 = {1: 12.7062, 2: 4.3027, 4: 2.7764}  # Student t quantiles from the printed table


def test_ci_half_width_is_t_times_the_standard_error():
    ci = stats.mean_ci([1, 2, 3, 4, 5])  # mean 3, sample variance 10/4
    assert ci.mean == 3 and ci.std == pytest.approx(math.sqrt(2.5))
    assert ci.half == pytest.approx(T975[4] * math.sqrt(2.5) / math.sqrt(5), abs=1e-3)  # 1.9632
    assert (ci.lo, ci.hi) == pytest.approx((3 - 1.9632, 3 + 1.9632), abs=1e-3)
    assert stats.mean_ci([10, 20, 30]).half == pytest.approx(T975[2] * 10 / math.sqrt(3), abs=1e-3)
    one = stats.mean_ci([7.0])
    assert one.n == 1 and one.mean == 7.0 and math.isnan(one.half) and math.isnan(one.std)
    assert stats.mean_ci([]).n == 0 and math.isnan(stats.mean_ci([]).mean)


def t4_cdf(x: float) -> float:
    """Student t with 4 dof in closed form."""
    u = x / math.sqrt(1 + x * x / 4)
    return 0.5 + 0.375 * u * (1 - x * x / (12 * (1 + x * x / 4)))


def test_welch_equal_sizes_and_spreads_has_4_dof_and_the_closed_form_p():
    # a = 1, 2, 3 and b = 4, 5, 6: both variances 1, se = sqrt(1/3 + 1/3), t = -3 / se, dof = (2/3)^2 / (2 (1/3)^2 / 2) = 4.
    w = stats.welch([1, 2, 3], [4, 5, 6])
    se = math.sqrt(2 / 3)
    assert w.ok and w.diff == -3 and w.dof == pytest.approx(4) and w.t == pytest.approx(-3 / se)
    assert w.p == pytest.approx(2 * t4_cdf(-3 / se), rel=1e-9)  # 0.0213
    assert (w.lo, w.hi) == pytest.approx((-3 - T975[4] * se, -3 + T975[4] * se), abs=1e-3)
    assert w.p_below == pytest.approx(w.p / 2) and w.p_above == pytest.approx(1 - w.p / 2)


def t_density(x: float, nu: float) -> float:
    return math.exp(math.lgamma((nu + 1) / 2) - math.lgamma(nu / 2) - 0.5 * math.log(nu * math.pi)
                    - (nu + 1) / 2 * math.log1p(x * x / nu))


def two_sided_p(t: float, nu: float, steps: int = 20_000) -> float:
    """1 - 2 * integral_0^|t| of the t density (Simpson's rule)."""
    h = abs(t) / steps
    s = t_density(0, nu) + t_density(abs(t), nu)
    s += sum((4 if i % 2 else 2) * t_density(i * h, nu) for i in range(1, steps))
    return 1 - 2 * s * h / 3


def test_welch_unequal_sizes_against_the_welch_satterthwaite_formula_and_an_integrated_density():
    a, b = [10, 12, 15, 11, 14, 20], [3, 9, 4]
    ma, mb = sum(a) / 6, sum(b) / 3  # 13.667, 5.333
    va = sum((x - ma) ** 2 for x in a) / 5  # 13.067
    vb = sum((x - mb) ** 2 for x in b) / 2  # 10.333
    wa, wb = va / 6, vb / 3
    dof = (wa + wb) ** 2 / (wa ** 2 / 5 + wb ** 2 / 2)  # 4.39: fractional
    t = (ma - mb) / math.sqrt(wa + wb)
    w = stats.welch(a, b)
    assert w.dof == pytest.approx(dof) and 4 < dof < 5 and w.t == pytest.approx(t)
    assert w.p == pytest.approx(two_sided_p(t, dof), abs=1e-7)
    # scipy's own Welch test agrees (the report uses the t distribution only)
    ref = ttest_ind(a, b, equal_var=False)
    assert w.p == pytest.approx(ref.pvalue, rel=1e-9) and w.t == pytest.approx(ref.statistic)
    # The interval of the difference uses the same fractional dof: between the 4- and 5-dof table values.
    half = (w.hi - w.lo) / 2
    assert 2.5706 * math.sqrt(wa + wb) < half < T975[4] * math.sqrt(wa + wb)


def test_welch_and_one_sample_say_why_not_instead_of_raising():
    w = stats.welch([5.0], [1, 2, 3])
    assert not w.ok and w.diff == 3 and math.isnan(w.p) and "the group has n=1" in w.reason
    assert "the reference has n=0" in stats.welch([1, 2], []).reason
    assert "zero spread" in stats.welch([2, 2], [1, 1]).reason
    assert "n=1" in stats.one_sample([3.0]).reason
    # One sample -1, -2, -3: mean -2, sd 1, t = -2 sqrt(3); with 2 dof F(x) = 1/2 + x / (2 sqrt(2 + x^2)).
    t = stats.one_sample([-1, -2, -3])
    x = -2 * math.sqrt(3)
    assert t.dof == 2 and t.diff == -2 and t.t == pytest.approx(x)
    assert t.p == pytest.approx(2 * (0.5 + x / (2 * math.sqrt(2 + x * x))), rel=1e-9)


def test_score_is_the_mean_of_the_last_3_evaluations_after_step_0(tmp_path):
    make_run(tmp_path, "five", "grpo", 0, 1, {0: {"a": 90}, 10: {"a": 10}, 20: {"a": 20}, 30: {"a": 30}, 40: {"a": 50}},
             steps=40)
    make_run(tmp_path, "one", "grpo", 0, 2, {0: {"a": 90}, 40: {"a": 60}}, steps=40)
    make_run(tmp_path, "none", "grpo", 0, 3, {0: {"a": 90}}, steps=40)  # only the starting model: no score
    assert stats.score_steps({0: {"avg": 1}, 5: {"avg": 1}, 6: {"a": 1}, 7: {"avg": 2}}) == [5, 7]
    paths = make_report([tmp_path], tmp_path / "r", plots=False)
    with open(paths["csv"]) as f:
        rows = {(r["eval"], r["benchmark"]): r for r in csv.DictReader(f)}
    s = rows[("score", "avg")]
    assert s["values"] == "33.3333;60" and s["n"] == "2" and s["n_evals"] == "3;1;0"  # (20 + 30 + 50) / 3
    assert float(s["mean"]) == pytest.approx((100 / 3 + 60) / 2)
    assert float(s["ci_half"]) == pytest.approx(T975[1] * abs(60 - 100 / 3) / math.sqrt(2) / math.sqrt(2), abs=1e-2)
    assert rows[("last", "avg")]["values"] == "50;60;90" and rows[("last", "avg")]["n_evals"] == ""
    md = paths["markdown"].read_text()
    assert "| GRPO | 0 | 46.7 ± 169.4 (2) | 46.7 ± 169.4 (2) | 3, 1, 0 | 33.3, 60.0, - | - | - |" in md


def sweep(root, m2po_seeds=(1, 2, 3), notr=True, m2po_shift=0.0):
    """On-policy GRPO near 50, stale GRPO near 40, stale M2PO near 48 (+ m2po_shift) with a wide spread, GRPO
    without TR falling from 45 to 10."""
    for seed, (x, y, z) in zip((1, 2, 3), ((50, 51, 49), (48, 50, 52), (53, 49, 50))):
        make_run(root, f"grpo-0-{seed}", "grpo", 0, seed, {0: {"a": 20}, 10: {"a": x}, 20: {"a": y}, 30: {"a": z}}, steps=30)
    for seed, (x, y, z) in zip((1, 2, 3), ((40, 41, 39), (38, 42, 40), (41, 40, 40))):
        make_run(root, f"grpo-8-{seed}", "grpo", 2, seed, {0: {"a": 20}, 10: {"a": x}, 20: {"a": y}, 30: {"a": z}}, steps=30)
    for seed, xyz in zip((1, 2, 3), ((52, 44, 47), (49, 55, 45), (42, 46, 50))):
        if seed in m2po_seeds:
            x, y, z = (v + m2po_shift for v in xyz)
            make_run(root, f"m2po-8-{seed}", "m2po", 2, seed, {0: {"a": 20}, 10: {"a": x}, 20: {"a": y}, 30: {"a": z}},
                     steps=30)
    if notr:
        for seed, (best, x, y) in zip((1, 2), ((45, 12, 8), (44, 15, 11))):
            make_run(root, f"notr-8-{seed}", "grpo_notr", 2, seed, {0: {"a": 20}, 10: {"a": best}, 20: {"a": x},
                                                                  30: {"a": y}}, steps=30)
    return root


SCORES = {"on": [50, 50, 152 / 3], "stale": [40, 40, 121 / 3], "m2po": [143 / 3, 149 / 3, 46]}  # mean of 10, 20, 30


def mean(xs):
    return sum(xs) / len(xs)


def test_claims_state_the_verdicts_with_the_p_values(tmp_path):
    md = make_report([sweep(tmp_path / "s")], tmp_path / "r", plots=False)["markdown"].read_text()
    claims = md.split("## Claims")[1].split("Held-out pass@1")[0]
    assert "collapses** if its score falls below its step-0 accuracy or more than 10 points below its own best" in claims
    m2po_vs_on = ttest_ind(SCORES["m2po"], SCORES["on"], equal_var=False)
    line = next(ln for ln in claims.splitlines() if ln.startswith("- **M2PO s=8 vs on-policy GRPO**"))
    diff = mean(SCORES["m2po"]) - mean(SCORES["on"])  # -2.4, p = 0.14
    assert m2po_vs_on.pvalue > 0.05 and f"Δ = {diff:+.1f} points" in line and f"p = {m2po_vs_on.pvalue:.3f}" in line
    assert "not significantly different at 0.05, i.e. within noise; this is not equivalence: the interval" in line
    lo, hi = m2po_vs_on.confidence_interval(0.95)
    assert f"still admits a difference from {lo:+.1f} to {hi:+.1f} points" in line
    assert f"Against stale GRPO at s=8: Δ = {mean(SCORES['m2po']) - mean(SCORES['stale']):+.1f} points" in line
    stale = next(ln for ln in claims.splitlines() if ln.startswith("- **GRPO s=8 below on-policy GRPO?**"))
    p = ttest_ind(SCORES["stale"], SCORES["on"], equal_var=False, alternative="less").pvalue
    shown = "p < 0.001" if p < 0.001 else f"p = {p:.3f}"
    assert p < 0.05 and f"one-sided Welch test (alternative: stale < on-policy) {shown}: yes, below at 0.05" in stale
    notr = next(ln for ln in claims.splitlines() if ln.startswith("- **GRPO (no TR) s=8 collapses?**"))
    # Scores (45 + 12 + 8) / 3 = 21.7 and (44 + 15 + 11) / 3 = 23.3: above the start (20) but > 10 below the best.
    assert "yes, in every run, by the rule above (per run: score 21.7, 23.3; step 0 20.0, 20.0; best 45.0, 44.0)" in notr


def test_a_stale_m2po_clearly_below_on_policy_is_not_within_noise(tmp_path):
    md = make_report([sweep(tmp_path / "s", m2po_shift=-8, notr=False)], tmp_path / "r", plots=False)["markdown"]
    line = next(ln for ln in md.read_text().splitlines() if ln.startswith("- **M2PO s=8 vs on-policy GRPO**"))
    p = ttest_ind([x - 8 for x in SCORES["m2po"]], SCORES["on"], equal_var=False).pvalue
    assert p < 0.05 and f"p = {p:.3f}: significantly below on-policy GRPO at 0.05; not within noise" in line


def test_claims_only_for_the_groups_that_exist_and_no_crash_for_n_1(tmp_path):
    md = make_report([sweep(tmp_path / "s", m2po_seeds=(2,), notr=False)], tmp_path / "r", plots=False)["markdown"]
    text = md.read_text()
    assert "collapses" not in text  # no GRPO without trust region
    assert ("- **M2PO s=8 vs on-policy GRPO**: no verdict: the group has n=1; a test needs n >= 2 in both. "
            "Against stale GRPO at s=8: no test: the group has n=1") in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| M2PO | 8 |"))
    assert row.endswith("| n/a (the group has n=1; a test needs n >= 2 in both) | n/a (the group has n=1; a test "
                        "needs n >= 2 in both) |")
    root = tmp_path / "on"
    make_run(root, "grpo", "grpo", 0, 1, {10: {"a": 1}})
    assert "## Claims" not in make_report([root], tmp_path / "r2", plots=False)["markdown"].read_text()


CSV_HEAD = ["model", "method", "staleness", "variant", "eval", "benchmark", "mean", "std", "n", "ci_half", "ci_lo",
            "ci_hi", "n_evals", "values", "runs"] + [f"vs_{r}_{c}" for r in ("onpolicy", "stale_grpo") for c in
                                                     ("ref", "diff", "lo", "hi", "dof", "p", "p_below", "note")]


def test_csv_columns_carry_the_intervals_and_the_tests(tmp_path):
    path = make_report([sweep(tmp_path / "s")], tmp_path / "r", plots=False)["csv"]
    with open(path) as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == CSV_HEAD
        rows = {(r["method"], r["eval"], r["benchmark"]): r for r in reader}
    m = rows[("m2po", "score", "avg")]
    ref = ttest_ind(SCORES["m2po"], SCORES["on"], equal_var=False)
    assert m["vs_onpolicy_ref"] == "GRPO s=0" and float(m["vs_onpolicy_p"]) == pytest.approx(ref.pvalue, rel=1e-5)
    assert float(m["vs_onpolicy_dof"]) == pytest.approx(ref.df, rel=1e-5)
    assert float(m["vs_onpolicy_lo"]) < float(m["vs_onpolicy_diff"]) < float(m["vs_onpolicy_hi"])
    assert m["vs_stale_grpo_ref"] == "GRPO s=8" and float(m["vs_stale_grpo_diff"]) == pytest.approx(mean(SCORES["m2po"]) - mean(SCORES["stale"]))
    g = rows[("grpo", "score", "avg")]  # stale GRPO is the stale reference itself: no such test
    assert g["vs_onpolicy_ref"] == "GRPO s=0" and g["vs_stale_grpo_ref"] == "" and g["vs_stale_grpo_p"] == ""
    ci = stats.mean_ci(SCORES["m2po"])
    assert float(m["ci_lo"]) == pytest.approx(ci.lo, rel=1e-5) and float(m["std"]) == pytest.approx(ci.std, rel=1e-5)
    assert rows[("m2po", "last", "avg")]["vs_onpolicy_p"] == ""  # the tests are on the score only


def test_the_reference_is_the_grpo_group_of_the_same_config(tmp_path):
    root = sweep(tmp_path / "s", notr=False)
    # A second on-policy GRPO variant at another learning rate: M2PO (at the default) is compared with the first.
    for seed in (1, 2):
        make_run(root, f"grpo-lr-{seed}", "grpo", 0, seed, {30: {"a": 0.0 + seed}}, extra={"optim.lr": 0.1}, steps=30)
    groups = summarize([load_run(p) for p in find_runs([root])])
    from m2po_megatron.sweep.claims import reference
    m2po = next(g for g in groups if g.method == "m2po")
    ref, note = reference(m2po, groups, "0")
    assert ref is not None and ref.variant == "optim.lr=None" and note == ""
    # Only one candidate, in another config: used, and the note says what differs.
    other = tmp_path / "o"
    make_run(other, "g", "grpo", 0, 1, {30: {"a": 1}}, extra={"optim.lr": 0.1}, steps=30)
    make_run(other, "m", "m2po", 2, 1, {30: {"a": 1}}, steps=30)
    groups = summarize([load_run(p) for p in find_runs([other])])
    ref, note = reference(next(g for g in groups if g.method == "m2po"), groups, "0")
    assert ref.method == "grpo" and note == "the reference differs in optim.lr: (unset) here, 0.1 there"


def test_ci_band_and_plots_are_written(tmp_path):
    xs, mean, lo, hi = ci_band([{1: 10.0, 2: 1.0}, {1: 20.0}, {1: 30.0}])
    assert xs == [1, 2] and mean == [20.0, 1.0]
    assert (lo[0], hi[0]) == pytest.approx((20 - T975[2] * 10 / math.sqrt(3), 20 + T975[2] * 10 / math.sqrt(3)), abs=1e-2)
    assert math.isnan(lo[1]) and math.isnan(hi[1])  # one run at step 2: no band
    groups = summarize([load_run(p) for p in find_runs([sweep(tmp_path / "s")])])
    paths = plot_groups(groups, tmp_path)
    assert [p.name for p in paths] == ["curves.png", "diagnostics.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)
