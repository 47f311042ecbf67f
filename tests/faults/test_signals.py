"""SIGTERM, SIGUSR1, a second signal and kill -9 of the driver, on real runs of the tiny task. Faults are
driven by observable events (rows in metrics.jsonl, lines in the driver's output); every wait has a
deadline that only fails the test."""
import signal

import pytest

from harness import (RUN_TIMEOUT, Driver, assert_accounting, assert_checkpoints_intact, assert_nothing_left,
                     assert_steps_once, checkpoints, rollout_port, small, step_rows)

DETERMINISTIC = ("reward/mean", "response_length/mean", "loss", "grad_norm", "m2po/m2_before", "staleness/mean",
                 "staleness/max", "samples/generated", "samples/consumed", "samples/pending", "kl/k3")
# with the KL to the reference model and the entropy bonus on: a resumed run rebuilds the reference from the
# initial weights (a checkpoint carries no copy), so its KL equals the uninterrupted run's
WITH_KL = DETERMINISTIC + ("kl_loss", "kl_ref/k3", "entropy")


def start(drivers, short_tmp, tmp_path, name, *args):
    d = Driver(["tiny-cpu", *args], tmp_path / f"{name}.log", short_tmp)
    drivers.append(d)
    return d


@pytest.mark.timeout(4 * RUN_TIMEOUT)
def test_sigterm_mid_step_checkpoints_and_the_fixed_lag_resume_equals_the_uninterrupted_run(
        tiny_task, tmp_path, short_tmp, drivers):
    lag = ["staleness.mode=fixed_lag", "staleness.lag_steps=1", "staleness.behav_logprob_source=trainer",
           "train.steps=4", "algo.use_kl_loss=true", "algo.entropy_coeff=0.001"]
    full = start(drivers, short_tmp, tmp_path, "full", *small(tiny_task, tmp_path, "full", *lag))
    assert full.finish() == 0, full.output()[-5000:]
    ref = step_rows(tmp_path / "full")
    # the released code's simulation: step 1 trains base-model data, later steps have staleness k x U = 2
    assert [r["staleness/max"] for r in ref] == [0, 2, 2, 2]
    # the reference is the initial weights: no KL at the first update, then some as soon as the policy has moved
    # (each step measures it on new samples, so it need not grow monotonically)
    assert ref[0]["updates"][0]["kl_ref/k3"] == 0 and ref[0]["updates"][0]["kl_loss"] == 0
    assert ref[0]["updates"][1]["kl_ref/k3"] > 0 and all(r["kl_ref/k3"] > 0 for r in ref[1:])

    cut = start(drivers, short_tmp, tmp_path, "cut", *small(tiny_task, tmp_path, "cut", *lag))
    cut.wait_rows(tmp_path / "cut", 1)
    cut.signal(signal.SIGTERM)  # while step 2 runs (or between steps): honoured after the step
    assert cut.finish() == 0, cut.output()[-5000:]
    assert "received SIGTERM; will checkpoint and stop after the current step" in cut.output()
    stopped = [r["step"] for r in step_rows(tmp_path / "cut")]
    assert checkpoints(tmp_path / "cut")[-1] == stopped[-1] and stopped == list(range(1, len(stopped) + 1))
    assert f"stopped by SIGTERM at step {stopped[-1]}/4" in cut.output()
    assert_nothing_left(cut, [rollout_port(tmp_path / "cut")])

    again = start(drivers, short_tmp, tmp_path, "again", "--resume", "auto", *small(tiny_task, tmp_path, "cut", *lag))
    assert again.finish() == 0, again.output()[-5000:]
    assert f"resuming from {tmp_path / 'cut' / 'checkpoints'}/step_{stopped[-1]:07d} (step {stopped[-1]})" \
        in again.output()
    assert_steps_once(tmp_path / "cut", [1, 2, 3, 4])
    resumed = step_rows(tmp_path / "cut")
    assert_accounting(resumed)
    for a, b in zip(ref, resumed):  # sampling is seeded per group: the same numbers at every step
        for key in WITH_KL:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key, a[key], b[key])
    assert_nothing_left(again, [rollout_port(tmp_path / "cut")])


@pytest.mark.timeout(5 * RUN_TIMEOUT)
def test_sigusr1_kill9_and_a_second_sigterm_each_resume_from_their_checkpoint(tiny_task, tmp_path, short_tmp,
                                                                             drivers):
    run = tmp_path / "b"
    args = small(tiny_task, tmp_path, "b", "staleness.mode=bounded", "staleness.max_staleness=2", "train.steps=6")

    # SIGUSR1 (Slurm's warning before the time limit): checkpoint after the step, exit 0
    d = start(drivers, short_tmp, tmp_path, "usr1", *args)
    d.wait_rows(run, 1)
    d.signal(signal.SIGUSR1)
    assert d.finish() == 0, d.output()[-5000:]
    assert "received SIGUSR1" in d.output() and "continue with `--resume auto`" in d.output()
    k1 = checkpoints(run)[-1]
    assert [r["step"] for r in step_rows(run)] == list(range(1, k1 + 1))
    assert_nothing_left(d, [rollout_port(run)])

    # kill -9 of the driver right after a new row: the guardian reaps Ray, the server and the reward
    # workers, and removes the private Ray temp dir; nothing listens on the run's ports any more
    d = start(drivers, short_tmp, tmp_path, "kill9", "--resume", "auto", *args)
    d.wait_for("the resume", lambda: "resuming from" in d.output())  # older rows are truncated by now
    d.wait_rows(run, k1 + 1)
    port = rollout_port(run)
    d.signal(signal.SIGKILL)
    assert d.finish() == -signal.SIGKILL
    assert_nothing_left(d, [port])
    k2 = checkpoints(run)[-1]
    assert k2 >= k1

    # a second SIGTERM while the first is honoured: leave now, without a new checkpoint (or, if the stop
    # had already finished, exit 0); either way the checkpoints stay complete and resumable
    d = start(drivers, short_tmp, tmp_path, "twice", "--resume", "auto", *args)
    d.wait_for("the resume", lambda: "resuming from" in d.output())
    d.wait_rows(run, k2 + 1)
    d.signal(signal.SIGTERM)
    d.wait_for("the stop to be acknowledged", lambda: "will checkpoint and stop" in d.output())
    d.signal(signal.SIGTERM)
    rc = d.finish()
    assert rc in (0, 128 + signal.SIGTERM), d.output()[-5000:]
    if rc != 0:
        assert "second SIGTERM: exiting now without a new checkpoint" in d.output()
    assert_nothing_left(d, [rollout_port(run)])
    k3 = checkpoints(run)[-1]
    assert_checkpoints_intact(run)

    # the last resume completes the run: every step once, the identity on every row and across resumes
    d = start(drivers, short_tmp, tmp_path, "done", "--resume", "auto", *args)
    assert d.finish() == 0, d.output()[-5000:]
    assert f"(step {k3})" in d.output()
    assert "train 6/6 (100%)" in d.output()  # the progress counts from the checkpoint's step
    assert_steps_once(run, [1, 2, 3, 4, 5, 6])
    rows = step_rows(run)
    assert_accounting(rows)
    assert all(r["staleness/max"] <= 2 for r in rows)
    assert_nothing_left(d, [rollout_port(run)])
