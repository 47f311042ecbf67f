"""Qwen3-MoE in the actor on CPU/gloo: expert parallelism trains as one rank does, and routing replay (R3, R2)
is exact in the forward and in a full-recompute backward, observed at the routers' outputs."""
import pytest

import actor_workers as w
from m2po_megatron.actor.launch import run_multiprocess

JOBS_DP2 = [dict(ep=1), dict(ep=2), dict(ep=2, replay="r3", observe=True, recompute=True), dict(ep=2, replay="r2"),
            dict(tp=2, sp=True), dict(tp=2, sp=True, replay="r3", recompute=True),
            dict(tp=2, sp=True, replay="r2", observe=True, recompute=True)]
JOBS_DP1 = [dict(), dict(replay="r3", observe=True, recompute=True), dict(replay="r2")]


def _maxdiff(a, b):
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def runs():
    dp2 = run_multiprocess(w.moe_train_worker, 2, args=(JOBS_DP2,), timeout=620)
    dp1 = run_multiprocess(w.moe_train_worker, 1, args=(JOBS_DP1,), timeout=300)[0]
    return dp2, dp1


@pytest.mark.timeout(900)
def test_expert_parallel_update_equals_one_rank(runs):
    """One SGD update of GRPO: EP2 (2 experts a rank, tokens all-gathered to them) gives EP1's weights at DP2,
    and DP1's on the same global batch."""
    dp2, dp1 = runs
    for rank in (0, 1):
        ep1, ep2 = dp2[rank][0], dp2[rank][1]
        assert ep1["dp"] == ep2["dp"] == 2
        assert _maxdiff(ep1["weights"], ep2["weights"]) <= 1e-6
        assert _maxdiff(ep2["weights"], dp1[0]["weights"]) <= 2e-5
        assert ep2["metrics"]["loss"] == pytest.approx(dp1[0]["metrics"]["loss"], rel=1e-5)
    assert dp2[0][1]["metrics"] == dp2[1][1]["metrics"] | {k: v for k, v in dp2[0][1]["metrics"].items()
                                                           if k.startswith("time/")}


@pytest.mark.timeout(900)
def test_tensor_and_sequence_parallel_update_equals_one_rank(runs):
    """TP2 with sequence parallelism (each rank routes its half of the tokens; experts over ETP = TP = 2): one
    SGD update gives one rank's weights, without replay and with R3 under full recompute (each rank replays
    the targets of its own half of the sequence: a wrong slice would route other tokens to other experts)."""
    dp2, dp1 = runs
    for rank in (0, 1):
        tp2, tp2_r3 = dp2[rank][4], dp2[rank][5]
        assert tp2["dp"] == tp2_r3["dp"] == 1
        assert _maxdiff(tp2["weights"], dp1[0]["weights"]) <= 2e-5
        assert tp2["metrics"]["loss"] == pytest.approx(dp1[0]["metrics"]["loss"], rel=1e-5)
        assert _maxdiff(tp2_r3["weights"], dp1[1]["weights"]) <= 2e-5
        assert _maxdiff(tp2_r3["weights"], tp2["weights"]) > 1e-3  # the replay changed the update
        m, m1 = tp2_r3["metrics"], dp1[1]["metrics"]
        for k in ("routing/replayed_tokens", "routing/replayed_tokens_recompute", "routing/mismatch"):
            assert m[k] == pytest.approx(m1[k], rel=1e-6), k


@pytest.mark.timeout(900)
def test_r3_replay_is_exact_in_forward_and_recompute(runs):
    """R3 targets unlike the router's own choice (random experts for every response token): the experts each
    router dispatched to equal the targets for every such token, in the forward and again when full
    recompute re-runs the layers in backward; the replay counts agree, and the update is not the unreplayed one."""
    dp2, dp1 = runs
    for res, none in [(dp2[0][2], dp2[0][1]), (dp2[1][2], dp2[1][1]), (dp1[1], dp1[0])]:
        for where in ("forward", "recompute"):
            n_target, n_equal = res["exact"][where]
            assert n_target > 0 and n_equal == n_target, (where, res["exact"])
        m = res["metrics"]
        assert m["routing/replayed_tokens"] == m["routing/replayed_tokens_recompute"] > 0
        assert 0.3 < m["routing/mismatch"] < 1.0  # the router would have chosen otherwise for most tokens
        assert m["routing/logprob_mismatch"] > m["routing/logprob_mismatch_noreplay"]  # random experts hurt
        assert _maxdiff(res["weights"], none["weights"]) > 1e-3
    assert _maxdiff(dp2[0][2]["weights"], dp1[1]["weights"]) <= 2e-5  # EP2 x DP2 replays as one rank does


@pytest.mark.timeout(900)
def test_r2_replays_the_step_start_routing(runs):
    """R2 records the trainer's own routing in a no-grad pass at the step's weights and replays it: with one
    update per step that is the routing the update would have had, so the update equals no replay's, and
    every token was replayed with no mismatch."""
    dp2, dp1 = runs
    for res, none in [(dp2[0][3], dp2[0][1]), (dp1[2], dp1[0])]:
        m = res["metrics"]
        assert m["routing/mismatch"] == 0.0 and m["routing/replayed_tokens"] > 0
        assert m["routing/logprob_mismatch_noreplay"] > 0
        assert _maxdiff(res["weights"], none["weights"]) <= 1e-6


@pytest.mark.timeout(900)
def test_r2_at_tp2_with_sequence_parallelism(runs):
    """R2 at TP2 with sequence parallelism (each rank's routers record and replay only their half of each
    row; the recording is gathered over TP into whole sequences): every token each rank's routers dispatch, in
    the forward and in the full recompute, goes to the experts recorded for it; the two halves together
    replay every token of the batch, as one rank does, with no mismatch, and the update is the unreplayed one."""
    dp2, dp1 = runs
    one_rank = dp1[2]["metrics"]["routing/replayed_tokens"]
    for where in ("forward", "recompute"):
        per_rank = [dp2[rank][6]["exact"][where] for rank in (0, 1)]
        for n_target, n_equal in per_rank:
            assert n_target > 0 and n_equal == n_target, (where, per_rank)
        assert sum(n for n, _ in per_rank) == one_rank, (where, per_rank)
    for rank in (0, 1):
        res, none = dp2[rank][6], dp2[rank][4]
        m = res["metrics"]
        assert m["routing/mismatch"] == 0.0
        assert m["routing/replayed_tokens"] == m["routing/replayed_tokens_recompute"] == one_rank
        assert _maxdiff(res["weights"], none["weights"]) <= 1e-6
        assert _maxdiff(res["weights"], dp1[2]["weights"]) <= 2e-5
