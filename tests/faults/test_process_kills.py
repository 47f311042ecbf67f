"""kill -9 of the rollout server process, of its Ray actor and of a trainer rank, and two runs at once on
one machine, on real runs of the tiny task."""
import os
import signal

import pytest

from harness import (RUN_TIMEOUT, Driver, assert_accounting, assert_nothing_left, assert_steps_once, checkpoints,
                     placement, rollout_port, small, step_rows)


def start(drivers, short_tmp, tmp_path, name, *args):
    d = Driver(["tiny-cpu", *args], tmp_path / f"{name}.log", short_tmp)
    drivers.append(d)
    return d


def restarts_seen(run, n):
    return lambda: any(r.get("rollout/server_restarts", 0) >= n for r in step_rows(run))


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_server_process_and_actor_killed_are_recovered_a_dead_trainer_rank_stops_the_run(
        tiny_task, tmp_path, short_tmp, drivers):
    run = tmp_path / "r"
    args = small(tiny_task, tmp_path, "r", "staleness.mode=bounded", "staleness.max_staleness=2",
                 "rollout.max_restarts=2")
    # more steps than the run can reach before the trainer kill below ends it: its end is the kill, never
    # a race between the last steps and the kill
    d = start(drivers, short_tmp, tmp_path, "faults", *args, "train.steps=100000")
    d.wait_rows(run, 1)
    server = placement(run, "rollout")[0]

    # the server process: its actor restarts it on the same port, the loop re-syncs the weights
    os.kill(server["pid"], signal.SIGKILL)
    d.wait_for("the server restart in the metrics", restarts_seen(run, 1), run_dir=run)

    # its Ray actor: the server process goes with it (no orphan keeps the port) and a new actor serves
    # the same URL; no ActorDiedError reaches the driver
    os.kill(server["actor_pid"], signal.SIGKILL)
    d.wait_for("the actor restart in the metrics", restarts_seen(run, 2), run_dir=run)
    assert not os.path.exists(f"/proc/{server['pid']}")
    assert "died (ActorDiedError); starting a new one on the same port" in d.output()

    # a trainer rank: the run stops with a message naming the checkpoint to resume from
    n = len(step_rows(run))
    os.kill(placement(run, "trainer")[0]["pid"], signal.SIGKILL)
    assert d.finish() == 1, d.output()[-5000:]
    k = checkpoints(run)[-1]
    assert "a trainer rank died during" in d.output()
    assert f"Resume from {run / 'checkpoints'}/step_{k:07d} with `--resume auto`" in d.output()
    assert "Traceback (most recent call last)" not in d.output()  # the cause, not a stack, is reported
    assert n <= k + 1
    assert_nothing_left(d, [rollout_port(run)])

    d = start(drivers, short_tmp, tmp_path, "resume", "--resume", "auto", *args, f"train.steps={k + 2}")
    assert d.finish() == 0, d.output()[-5000:]
    assert f"(step {k})" in d.output()
    assert_steps_once(run, list(range(1, k + 3)))
    rows = step_rows(run)
    assert_accounting(rows)
    assert all(r["staleness/max"] <= 2 for r in rows)
    assert_nothing_left(d, [rollout_port(run)])


@pytest.mark.timeout(2 * RUN_TIMEOUT)
def test_two_runs_at_once_each_train_against_their_own_server(tiny_task, tmp_path, short_tmp, drivers):
    """Both use the default rollout.port = 0: each launcher binds its own free port and checks the
    server's identity before use, so neither run can reach the other's server."""
    a = start(drivers, short_tmp, tmp_path, "a", *small(tiny_task, tmp_path, "a", "train.steps=2"))
    b = start(drivers, short_tmp, tmp_path, "b", *small(tiny_task, tmp_path, "b", "train.steps=2"))
    assert a.finish() == 0, a.output()[-5000:]
    assert b.finish() == 0, b.output()[-5000:]
    pa, pb = placement(tmp_path / "a", "rollout")[0], placement(tmp_path / "b", "rollout")[0]
    assert pa["url"] != pb["url"] and pa["identity"] != pb["identity"]
    for run in (tmp_path / "a", tmp_path / "b"):
        assert_steps_once(run, [1, 2])
        assert_accounting(step_rows(run))
    assert_nothing_left(a, [rollout_port(tmp_path / "a")])
    assert_nothing_left(b, [rollout_port(tmp_path / "b")])
