"""Reward table on real math-verify, the box extractor, and the process pool's time limit."""

import threading

import pytest

from m2po_megatron.reward import RewardInput, RewardPool, judge, last_boxed, math_verify_reward
from m2po_megatron.reward.pool import MATH_VERIFY

MATH = MATH_VERIFY[0]


def items(responses, answers):
    return [RewardInput(r, [], {"answer": a}) for r, a in zip(responses, answers)]

FS = 0.1  # a distinctive format score so "wrong but extracted" is told apart from "no answer"

# (response, gold answer, expected score with format_score=FS)
TABLE = [
    # fractions, decimals
    (r"so the answer is \boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\dfrac{3}{4}}", "3/4", 1.0),
    (r"\boxed{-82/9}", r"-\frac{82}{9}", 1.0),
    (r"\boxed{0.33}", r"\frac{1}{3}", FS),
    (r"\boxed{\frac12}", "0.5", 1.0),
    # intervals
    (r"\boxed{(1,2]}", "(1,2]", 1.0),
    (r"\boxed{(1,2)}", "[1,2)", FS),
    (r"\boxed{(-\infty, 3)}", r"(-\infty,3)", 1.0),
    # percentages
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{0.5}", r"50\%", 1.0),
    # LaTeX variants
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"(3,\pi/2)", 1.0),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{12}", 1.0),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    (r"\boxed{10^{3}}", "1000", 1.0),
    (r"\boxed{1{,}000}", "1000", 1.0),
    (r"\boxed{x=5}", "5", 1.0),
    (r"\boxed{2,1}", "1,2", 1.0),
    (r"\boxed{\pi}", r"\pi", 1.0),
    (r"\fbox{7}", "7", 1.0),
    (r"\boxed 7", "7", 1.0),
    (r"$\boxed{ 12 }$", "12", 1.0),
    # \text{} units and multiple choice
    (r"\boxed{10 \text{ cm}}", "10", 1.0),
    (r"\boxed{10}", r"10\text{ cm}", 1.0),
    (r"\boxed{\text{(C)}}", "C", 1.0),
    (r"\boxed{B}", "C", FS),
    # no box, empty box, unclosed box
    ("the answer is 5", "5", 0.0),
    (r"\boxed{}", "5", 0.0),
    (r"\boxed{5", "5", 0.0),
    ("", "5", 0.0),
    # several boxes: the last wins
    (r"\boxed{3} no wait \boxed{4}", "4", 1.0),
    (r"\boxed{4} no wait \boxed{3}", "4", FS),
    # nested braces
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
    (r"\boxed{\{1, 2\}}", r"\{1,2\}", 1.0),
    (r"\boxed{\frac{1}{{2}}}", "0.5", 1.0),
    # wrong numbers
    (r"\boxed{3}", "4", FS),
    (r"\boxed{-4}", "4", FS),
]


def test_table_size():
    assert len(TABLE) >= 30


@pytest.mark.parametrize("response,answer,expected", TABLE)
def test_reward_table(response, answer, expected):
    assert math_verify_reward(response, answer, format_score=FS) == expected


def test_format_score_default_is_zero():
    assert math_verify_reward(r"\boxed{3}", "4") == 0.0
    assert math_verify_reward(r"\boxed{4}", "4") == 1.0


@pytest.mark.parametrize(
    "text,expected",
    [
        (r"a \boxed{\frac{1}{2}} b", r"\frac{1}{2}"),
        (r"\boxed{a} \boxed{b}", "b"),
        (r"\boxed{x^{2^{3}}}", "x^{2^{3}}"),
        (r"\boxed{\{1\}}", r"\{1\}"),
        (r"\boxed{\}}", r"\}"),
        (r"\boxed{}", None),
        (r"\boxed{1", None),
        ("nothing", None),
        (r"\boxedfoo{1}", None),
        (r"\boxed{1} \fbox{2}", "2"),
        (r"\boxed 42 and more", "42"),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_empty_gold_is_a_clear_error():
    with pytest.raises(ValueError, match="answer"):
        math_verify_reward(r"\boxed{1}", "")


def test_judge_off_main_thread_does_not_raise():
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", judge(r"\boxed{\frac{1}{2}}", "0.5")))
    t.start()
    t.join(120)  # the first call off the main thread starts a worker process
    assert out["v"].score == 1.0 and out["v"].status == "correct"


@pytest.mark.timeout(120)
def test_pool_matches_serial_and_counts():
    responses = [r for r, _, _ in TABLE]
    answers = [a for _, a, _ in TABLE]
    with RewardPool([(MATH, {"format_score": FS})], num_workers=2, timeout_s=20.0) as pool:
        outs, stats = pool.score(items(responses, answers))
    assert [o.score for o in outs] == [e for _, _, e in TABLE]
    assert stats.n == len(TABLE) and stats.timeouts == 0 and stats.errors == 0
    assert sum(o.extras["acc"] for o in outs) == sum(e == 1.0 for _, _, e in TABLE)
    assert sum(o.extras["no_answer"] for o in outs) == sum(e == 0.0 for _, _, e in TABLE)


@pytest.mark.timeout(120)
def test_pool_kills_adversarial_item_and_keeps_working():
    # 9^(9^(9^9)) as an exact integer: sympy would compute for far longer than any test; no Python signal
    # can interrupt it, so the pool must kill the worker.
    bomb = r"\boxed{9^{9^{9^{9}}}}"
    with RewardPool([(MATH, {"format_score": FS})], num_workers=2, timeout_s=2.0) as pool:
        outs, stats = pool.score(items([bomb, r"\boxed{3}", r"\boxed{4}"], ["5", "3", "3"]))
        assert [o.score for o in outs] == [None, 1.0, FS] and outs[0].status == "timeout"
        assert stats.timeouts == 1 and stats.worker_restarts == 1
        # the replaced worker serves the next batch
        outs, stats = pool.score(items([r"\boxed{2}"] * 4, ["2"] * 4))
        assert [o.score for o in outs] == [1.0] * 4 and stats.timeouts == 0
        assert pool.total.timeouts == 1 and pool.total.n == 7
        procs = [w.proc for w in pool._workers]
    assert all(p.poll() is not None for p in procs)  # close() leaves no worker behind


def test_pool_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_workers"):
        RewardPool(num_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPool(num_workers=1, timeout_s=0)


@pytest.mark.timeout(300)
def test_adversarial_answers_score_zero_in_bounded_time():
    """math-verify's TimeoutException is a BaseException; on the main thread its own limit fires and the
    answer scores 0 (status error); off the main thread judge() scores in a worker process it kills."""
    bomb = r"\boxed{9^{9^{9^{9}}}}"
    v = judge(bomb, "3", timeout_s=2)
    assert (v.score, v.status) == (0.0, "error")
    assert math_verify_reward(bomb, "3") == 0.0
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", judge(bomb, "3", timeout_s=2)))
    t.start()
    t.join(240)  # the worker's start-up plus the limit; a hang fails here
    assert not t.is_alive() and (out["v"].score, out["v"].status) == (0.0, "error")
