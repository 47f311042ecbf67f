"""Reward functions by name or path, sync or async, float or dict, several weighted terms, failures scored or
dropped as the recipe says, DAPO's over-long buffer, and the checks that run before anything starts."""
import pytest
from omegaconf import OmegaConf

from m2po_megatron.config.schema import RunConfig
from m2po_megatron.reward import RewardInput, Rewards
from m2po_megatron.reward.checks import check_reward, needs_label
from m2po_megatron.reward.compose import Overlong, run_terms
from m2po_megatron.reward.functions import terms_of
from m2po_megatron.reward.overlong import overlong_penalty
from m2po_megatron.reward.pool import RewardPool

PLUGINS = "tests/reward/reward_plugins.py"


def cfg(**reward):
    c = OmegaConf.structured(RunConfig)
    return OmegaConf.merge(c, {"reward": reward, "rollout": {"max_new_tokens": 32}})


def item(text, n_tokens=4, **row):
    return RewardInput(text, list(range(n_tokens)), {"answer": "2", **row})


@pytest.mark.timeout(120)
def test_sync_and_async_functions_by_path_with_extras_and_weights():
    terms = terms_of({"terms": [{"function": f"{PLUGINS}:length_reward", "weight": 0.5, "args": {"target": 4}},
                                {"function": f"{PLUGINS}:keyword_reward", "weight": 2.0, "name": "kw"},
                                {"function": "math_verify", "weight": 1.0}]})
    assert [t.name for t in terms] == ["length_reward", "kw", "math_verify"]
    assert terms[0].target.startswith("/")  # resolved against the repo, so a worker in any cwd finds it
    with Rewards(terms, num_workers=2, timeout_s=30.0) as r:
        out = r.score([item(r"\boxed{2} yes", 4, keyword="yes"), item("no", 8, keyword="yes")])
        assert out[0].score == pytest.approx(0.5 * 1.0 + 2.0 * 1.0 + 1.0)
        assert out[1].score == pytest.approx(0.5 * 0.0 + 2.0 * 0.0 + 0.0)
        assert out[0].extras["kw/hit"] == 1.0 and out[0].extras["kw/chars"] == len(r"\boxed{2} yes")
        assert out[0].extras["math_verify/acc"] == 1.0 and out[0].acc == 1.0 and out[1].acc == 0.0
        stats = r.stats()
        assert stats["reward/n"] == 2 and stats["reward/kw/score"] == 0.5 and stats["reward/length_reward/score"] == 0.5
        assert "reward/failed" not in stats and r.stats() == {}  # read once


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_error", ["score", "drop"])
def test_failures_are_counted_and_scored_or_dropped(on_error, capsys):
    terms = terms_of({"terms": [{"function": f"{PLUGINS}:raises"}, {"function": f"{PLUGINS}:returns_nan"},
                                {"function": f"{PLUGINS}:returns_bool"},
                                {"function": f"{PLUGINS}:returns_dict_without_score"},
                                {"function": f"{PLUGINS}:length_reward"}]})
    with Rewards(terms, num_workers=1, timeout_s=30.0, on_error=on_error, error_score=-1.0) as r:
        (out,) = r.score([item("x", 4)])
        assert out.failed == "error"  # the first failing term's status
        if on_error == "drop":
            assert out.score is None
        else:
            assert out.score == pytest.approx(4 * -1.0 + 1.0)
        stats = r.stats()
        assert stats["reward/errors"] == 1 and stats["reward/bad_values"] == 3 and stats["reward/failed"] == 1
        assert stats.get("reward/dropped", 0) == (1 if on_error == "drop" else 0)
        r.score([item("x", 4)])  # the same failures again: counted, not said again
        err = capsys.readouterr().err
        assert err.count("reward term raises") == 1 and "KeyError" in err and "no such column" in err
        assert err.count("reward term returns_nan") == 1 and "not a finite number" in err


@pytest.mark.timeout(120)
def test_a_term_past_its_time_limit_is_killed_and_the_pool_serves_on():
    terms = terms_of({"terms": [{"function": f"{PLUGINS}:slow_when_asked", "timeout_s": 1.0}]})
    with Rewards(terms, num_workers=1, timeout_s=30.0) as r:
        out = r.score([item("slow"), item("fast"), item("fast")])
        assert [o.score for o in out] == [0.0, 1.0, 1.0] and out[0].failed == "timeout"
        stats = r.stats()
        assert stats["reward/timeouts"] == 1 and stats["reward/worker_restarts"] == 1


@pytest.mark.timeout(60)
def test_a_function_that_cannot_load_stops_the_pool_with_its_name():
    with pytest.raises(RuntimeError, match="NOT_CALLABLE"):
        RewardPool([(f"{PLUGINS}:NOT_CALLABLE", {})], num_workers=1).score([item("x")])


def test_overlong_buffer_is_verls_linear_penalty():
    assert overlong_penalty(20, 32, 8, 1.0) == 0.0  # before the buffer
    assert overlong_penalty(24, 32, 8, 1.0) == 0.0  # at its start
    assert overlong_penalty(28, 32, 8, 1.0) == pytest.approx(-0.5)
    assert overlong_penalty(32, 32, 8, 0.4) == pytest.approx(-0.4)
    assert overlong_penalty(40, 32, 8, 1.0) == pytest.approx(-1.0)  # capped at the factor


@pytest.mark.timeout(120)
def test_overlong_buffer_is_added_to_the_reward_and_logged():
    terms = terms_of({"function": f"{PLUGINS}:length_reward", "args": {"target": 28}})
    with Rewards(terms, num_workers=1, timeout_s=30.0, overlong=Overlong(32, 8, 1.0)) as r:
        out = r.score([item("x", 28)])
        assert out[0].score == pytest.approx(1.0 - 0.5) and out[0].extras["overlong_penalty"] == -0.5
        assert r.stats()["reward/overlong_penalty"] == -0.5


def test_math_verify_reads_the_recipes_label_column_and_format_score():
    c = OmegaConf.merge(cfg(format_score=0.1), {"data": {"label_key": "solution"}})
    (t,) = run_terms(c)
    assert t.args == {"label_key": "solution", "format_score": 0.1}
    assert needs_label(c.reward) and not needs_label(cfg(function=f"{PLUGINS}:length_reward").reward)


@pytest.mark.parametrize("reward, message", [
    ({"function": f"{PLUGINS}:two_args"}, "fn(response, token_ids, row, **args)"),
    ({"function": f"{PLUGINS}:NOT_CALLABLE"}, "not a function"),
    ({"function": "no_such_name"}, "no_such_name"),
    ({"function": "tests/reward/nope.py:f"}, "no file"),
    ({"terms": [{"function": "math_verify", "weight": float("nan")}]}, "reward.terms[0].weight"),
    ({"terms": [{"function": "math_verify", "args": {"lable_key": "x"}}]}, "lable_key"),
    ({"terms": [{"function": "math_verify", "timeout_s": 0}]}, "reward.terms[0].timeout_s"),
    ({"overlong_buffer": {"enable": True, "len": 64}}, "reward.overlong_buffer.len"),
    ({"args": {"x": 1}, "terms": [{"function": "math_verify"}]}, "reward.args is set but reward.terms"),
])
def test_bad_reward_recipes_are_named_before_anything_starts(reward, message):
    errors = check_reward(cfg(**reward))
    assert any(message in e for e in errors), errors


def test_the_default_recipe_passes_its_checks():
    assert check_reward(cfg()) == []
    assert check_reward(cfg(function=f"{PLUGINS}:keyword_reward")) == []
