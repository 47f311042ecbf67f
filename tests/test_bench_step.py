"""benchmarks/bench_step.py's reading of a run (no run here): a metrics.jsonl and config.yaml as `m2po train`
writes them, with an evaluation-only row, warm-up steps and a step that trained nothing."""
import json
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_step as bs  # noqa: E402


def _row(step, *, wait, train, sync, step_s, actor=None, reward_s=0.2, tokens=1000):
    r = {"step": step, "version": 2 * step, "time/wait_rollout": wait, "time/train": train,
         "time/weight_sync": sync, "time/step": step_s, "reward/seconds": reward_s, "batch/tokens": tokens,
         "tokens_per_s/gen": 500.0, "num_microbatches": 10}
    if actor is not None:  # train_step, logprob_pass, forward_backward, optimizer
        r.update(dict(zip(bs.ACTOR_KEYS, actor)))
    return r


def _run(tmp_path, rows, mode="bounded", dp=1):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"staleness": {"mode": mode},
                                                          "parallel": {"data_parallel_size": dp}}))
    rows, mode, dp = bs.read_run(tmp_path)
    return rows, mode, dp


ROWS = [{"step": 0, "eval/avg/pass@1": 40.0},  # the evaluation before training: not a step
        _row(1, wait=9.0, train=20.0, sync=1.0, step_s=31.0, actor=(19.0, 5.0, 10.0, 2.0)),  # warm-up
        _row(2, wait=0.5, train=4.0, sync=0.0, step_s=4.6, actor=(3.5, 1.0, 2.0, 0.25)),
        _row(3, wait=0.3, train=4.4, sync=0.6, step_s=5.4, actor=(3.9, 1.2, 2.2, 0.25), tokens=1200)]


def test_parts_of_the_kept_steps_add_up_to_the_step(tmp_path):
    rows, mode, dp = _run(tmp_path, ROWS)
    res = bs.breakdown(rows, skip=1, mode=mode, dp=dp)
    p = res["parts_s"]
    assert res["mode"] == "bounded" and res["steps"] == [2, 3]
    assert res["step_s"] == pytest.approx(5.0)
    assert p["generation"] == pytest.approx(0.4) and p["reward"] == 0.0  # bounded: scoring is in the background
    assert res["background_reward_s"] == pytest.approx(0.2)
    assert p["forward_backward"] == pytest.approx(2.1) and p["logprob_pass"] == pytest.approx(1.1)
    assert p["ray_call"] == pytest.approx(0.5) and p["actor_other"] == pytest.approx(0.25)
    assert p["loop_other"] == pytest.approx(0.1) and p["weight_sync"] == pytest.approx(0.3)
    assert sum(p.values()) == pytest.approx(res["step_s"])
    assert all(v >= 0 for v in p.values()), p
    assert res["tokens_per_s"] == pytest.approx(1100 / 5.0)
    text = bs.table(res)
    assert "| forward/backward | 2.100 | 42.0 % |" in text and "steps 2-3 (2 steps" in text
    assert "forward/backward 210 ms and log-prob pass 110 ms per micro-batch" in text


def test_serial_modes_count_the_reward_pool_inside_the_wait(tmp_path):
    rows, mode, dp = _run(tmp_path, ROWS, mode="on_policy", dp=2)
    res = bs.breakdown(rows, skip=1, mode=mode, dp=dp)
    assert res["parts_s"]["reward"] == pytest.approx(0.2) and res["parts_s"]["generation"] == pytest.approx(0.2)
    assert "5.0 micro-batches per step on rank 0: forward/backward 420 ms" in bs.table(res)  # 10 over 2 ranks


def test_a_step_that_trained_nothing_has_no_actor_parts_and_an_old_run_is_refused(tmp_path):
    rows, mode, _ = _run(tmp_path, ROWS + [_row(4, wait=2.0, train=0.0, sync=0.0, step_s=2.1)])
    res = bs.breakdown(rows, skip=2, mode=mode)
    assert res["steps"] == [3, 4] and res["parts_s"]["forward_backward"] == pytest.approx(1.1)
    assert sum(res["parts_s"].values()) == pytest.approx(res["step_s"])
    rows, mode, _ = _run(tmp_path, [_row(s, wait=1.0, train=3.0, sync=0.0, step_s=4.0) for s in (1, 2, 3)])
    with pytest.raises(SystemExit, match="predates the actor's step timers"):
        bs.breakdown(rows, skip=1, mode=mode)
    with pytest.raises(SystemExit, match="lower --skip"):
        bs.breakdown(rows, skip=3, mode=mode)
