"""The drift calibration's rules (sweep/calibration.py, docs/reproduce.md): each criterion decided at its
pre-registered threshold, the horizon fit, the choice by cost, and runs that cannot count."""
import math
from pathlib import Path

import pytest

from m2po_megatron.sweep import calibration as cal
from m2po_megatron.sweep.report import RunRecord

STEPS = 100


def record(name, lr=1e-4, prompts=16, *, series=None, evals=None, steps=STEPS, rule="remove", lag=16):
    method, stale = {"grpo-s0": ("grpo", False), "grpo-stale": ("grpo", True), "grpo_notr-stale": ("grpo_notr", True),
                     "m2po-remove": ("m2po", True), "m2po-cap": ("m2po", True)}[name]
    flat = {"optim.lr": lr, "train.prompts_per_step": prompts, "rollout.n_samples_per_prompt": 8,
            "train.updates_per_step": 4, "train.steps": steps, "algo.name": method, "algo.m2po.rule": rule,
            "staleness.mode": "fixed_lag" if stale else "on_policy", "staleness.lag_steps": lag if stale else 0}
    series = {k: dict(v) for k, v in (series or {}).items()}
    series.setdefault("version", {s: 4 * s for s in range(1, steps + 1)})
    return RunRecord(path=Path(f"/runs/{name}-{lr}-{prompts}"), model="m", method=method,
                     staleness=str(lag * 4) if stale else "0", seed=1, flat=flat,
                     evals={s: {"avg": v} for s, v in (evals or {}).items()}, series=series)


def const(v, steps=STEPS):
    return {s: v for s in range(1, steps + 1)}


def curve(a=60.0, b=30.0, c=40.0):
    return {t: a - b * math.exp(-t / c) for t in (0, 25, 50, 75, 100)}


def matching_cell(lr=1e-4, prompts=16, **over):
    """Every criterion just inside its bound."""
    v = dict(onpolicy=0.001, stale=0.015, masked=0.001, notr={0: 40.0, 4: 38.5, 8: 41, 12: 40, 16: 39})
    v.update(over)
    tokens = {"batch/tokens": const(5000.0)}
    return [record("grpo-s0", lr, prompts, series={"clip_frac": const(v["onpolicy"]), **tokens}, evals=curve()),
            record("grpo-stale", lr, prompts, series={"clip_frac": const(v["stale"])}),
            record("grpo_notr-stale", lr, prompts, evals=v["notr"]),
            record("m2po-remove", lr, prompts, series={"m2po/masked_frac": const(v["masked"])}),
            record("m2po-cap", lr, prompts, rule="cap", series={"m2po/masked_frac": const(0.0)})]


def test_a_cell_inside_every_bound_matches_and_each_bound_can_fail_it():
    (c,) = cal.cells(matching_cell())
    assert c.matches is True and c.passed == {"onpolicy_clip": True, "stale_clip": True, "m2po_masked": True,
                                              "notr": True}
    assert c.values["notr_drop"] == pytest.approx(-1.5)
    for over, failed in ((dict(onpolicy=0.0011), "onpolicy_clip"), (dict(stale=0.0049), "stale_clip"),
                         (dict(stale=0.0151), "stale_clip"), (dict(masked=0.0012), "m2po_masked"),
                         (dict(notr={0: 40.0, 4: 41, 8: 41, 12: 38.4, 16: 42}), "notr")):
        (c,) = cal.cells(matching_cell(**over))
        assert c.matches is False and [k for k, ok in c.passed.items() if not ok] == [failed], over


def test_the_means_are_over_steps_1_on_and_ignore_step_0():
    runs = matching_cell()
    runs[0].series["clip_frac"][0] = 0.5  # a step-0 row (evaluation only) never counts
    runs[1].series["clip_frac"] = {s: (0.004 if s <= 50 else 0.016) for s in range(1, STEPS + 1)}  # mean 1.0 %
    (c,) = cal.cells(runs)
    assert c.values["onpolicy_clip"] == pytest.approx(0.001) and c.values["stale_clip"] == pytest.approx(0.010)


def test_the_horizon_fit_recovers_a_saturating_curve_and_sets_the_cost():
    fit = cal.fit_saturation(curve(60, 30, 40))
    assert fit[0] == pytest.approx(60, rel=0.02) and fit[1] == pytest.approx(30, rel=0.02) and fit[2] == pytest.approx(40, rel=0.02)
    assert cal.horizon(fit) == 100  # 40 ln 10 = 92 -> 100
    assert cal.horizon(cal.fit_saturation(curve(60, 30, 200))) == 475  # 200 ln 10 = 460.5 -> 475
    assert cal.horizon(cal.fit_saturation({0: 50.0, 25: 48.0, 50: 45.0, 75: 44.0})) is None  # no gain
    (c,) = cal.cells(matching_cell())
    assert c.cost == pytest.approx(5000 * 100)


def test_the_cheapest_matching_cell_is_chosen_never_a_failing_one():
    slow = matching_cell(lr=5e-5)  # the same curve and tokens per step: the same cost as the next cell
    cheap = matching_cell(lr=1e-4)
    failing = matching_cell(lr=2e-4, masked=0.02)
    failing[0].series["batch/tokens"] = const(10.0)  # cheapest of all, but it does not match
    slow[0].evals = {t: {"avg": v} for t, v in curve(60, 30, 200).items()}  # horizon 475: costlier
    cs = cal.cells(slow + cheap + failing)
    assert [(c.lr, c.matches) for c in cs] == [(2e-4, False), (1e-4, True), (5e-5, True)]
    assert cal.choose(cs).lr == 1e-4
    text = cal.markdown(cs)
    assert "Chosen (the cheapest matching cell): lr 0.0001, mini-batch 32" in text


def test_unfinished_runs_and_missing_arms_leave_the_cell_undecided():
    runs = matching_cell()
    runs[1] = record("grpo-stale", series={"clip_frac": const(0.01, 60)}, steps=STEPS)  # stopped at step 60
    runs[1].series["version"] = {s: 4 * s for s in range(1, 61)}
    (c,) = cal.cells(runs)
    assert c.matches is None and c.passed["stale_clip"] is None and "grpo-stale" not in c.arms
    assert "Arms without a run yet: lr=0.0001/batch=32: grpo-stale." in cal.markdown([c])
    assert "No cell chosen yet" in cal.markdown([c])
    runs = matching_cell()
    del runs[2].evals[12]  # criterion 4 needs every evaluation at steps 4-16
    (c,) = cal.cells(runs)
    assert c.passed["notr"] is None and c.matches is None


def test_two_runs_of_one_arm_in_one_cell_are_refused():
    with pytest.raises(cal.CalibrationError, match="two runs of arm grpo-s0 in the cell lr=0.0001, batch=32"):
        cal.cells(matching_cell() + matching_cell()[:1])


def test_no_match_before_and_after_the_fallback_axis_and_the_figure(tmp_path):
    grid = matching_cell(lr=1e-4, masked=0.02) + matching_cell(lr=1e-4, prompts=64, masked=0.02)
    assert "the pre-registered fallback axis comes next" in cal.markdown(cal.cells(grid))
    fallback = [r for lr in cal.FALLBACK_LRS for p in (16, 64) for r in matching_cell(lr=lr, prompts=p, masked=0.002)]
    cs = cal.cells(grid + fallback[:-5])  # one fallback cell still missing: not done
    assert not cal.fallback_done(cs) and "fallback axis comes next" in cal.markdown(cs)
    cs = cal.cells(grid + fallback)
    assert cal.fallback_done(cs) and cal.choose(cs) is None
    assert "the pre-registered fallback axis included" in cal.markdown(cs) and "stops here" in cal.markdown(cs)
    cal.figure(cs, tmp_path / "calibration.png")
    assert (tmp_path / "calibration.png").stat().st_size > 10_000
