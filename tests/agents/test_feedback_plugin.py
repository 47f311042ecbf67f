"""A "verifier with feedback" environment as a rollout plug-in, written from docs/agents.md alone (by an engineer
who read no source of the package): it runs unchanged, its malformed variants are dropped with the page's
reasons, and `m2po config` refuses a function that is not async."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

PLUGIN = Path(__file__).resolve().parent / "feedback_plugin.py"


def m2po(*args, timeout=900):
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_AUTH_MODE="disabled", WANDB_MODE="disabled")
    return subprocess.run([sys.executable, "-m", "m2po_megatron.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def overrides(task, out, name, *extra):
    return [f"model.hf_path={task}", f"data.train_path={task / 'train.jsonl'}", "data.eval_paths=[]",
            f"run.output_dir={out}", f"run.name={name}", "train.prompts_per_step=8",
            "train.updates_per_step=2", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=24",
            "eval.interval=0", "checkpoint.interval=0", "reward.num_workers=1", *extra]


def step_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "samples/generated" in r]


def _explain(proc) -> str:
    return f"rc={proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"


def check_accounting(rows):
    for r in rows:
        assert r["samples/generated"] == r["samples/consumed"] + r["samples/dropped"] + r["samples/pending"], r


def total(rows, key):
    return sum(r.get(key, 0) or 0 for r in rows)


@pytest.mark.timeout(960)
def test_feedback_plugin_bounded_run(tiny_task, tmp_path):
    task = Path(tiny_task)
    proc = m2po("train", "tiny-cpu", *overrides(
        task, tmp_path, "fb",
        f"rollout.function={PLUGIN}:feedback", "rollout.function_args={max_turns: 2}",
        "staleness.mode=bounded", "train.steps=2"))
    assert proc.returncode == 0, _explain(proc)
    rows = step_rows(tmp_path / "fb")
    assert len(rows) == 2, rows
    check_accounting(rows)
    # Per-episode numbers, averaged per step as rollout/custom/<name>. They land on the row of the step
    # in which the episodes finished generating; a step in which none finished has no such keys.
    custom = [r for r in rows if "rollout/custom/turns" in r]
    assert custom, rows
    for r in custom:
        assert 1.0 <= r["rollout/custom/turns"] <= 2.0, r
        ftc = r["rollout/custom/first_try_correct"]
        assert 0.0 <= ftc <= 1.0, r
        assert r["rollout/custom/final_correct"] >= ftc - 1e-9, r
        assert r["rollout/custom/env_tokens"] > 0, r
        assert r["rollout/custom/env_mask_ok"] == 1.0, r      # the plug-in's own check of the mask
        # the page's metric: the environment's share of the response tokens (mask 0)
        assert 0.0 < r["rollout_fn/env_token_frac"] < 1.0, r
        assert r["rollout_fn/generate_calls_per_group"] >= 4, r   # n=4 samples, >= 1 call each
    for r in rows:
        # environment tokens are masked: only the policy's tokens reach the loss
        assert r["num_tokens"] == r["batch/policy_tokens"], r
        response_tokens = r["response_length/mean"] * r["batch/sequences"]
        assert r["batch/policy_tokens"] < response_tokens, r
        assert r["batch/policy_tokens"] == pytest.approx(response_tokens * (1 - r["response/env_token_frac"]), abs=0.5)
        # the function scores: the recipe's reward is not called
        assert r.get("reward/n", 0) == 0, r
        # no drops of any kind
        assert r["samples/dropped"] == 0, r
        drops = {k: v for k, v in r.items() if k.startswith(("rollout_fn/dropped/", "samples/dropped/")) and v}
        assert not drops, drops


@pytest.mark.timeout(960)
def test_feedback_plugin_malformed_variants(tiny_task, tmp_path):
    task = Path(tiny_task)
    proc = m2po("train", "tiny-cpu", *overrides(
        task, tmp_path, "bad",
        f"rollout.function={PLUGIN}:mixed", "rollout.function_timeout_s=6",
        "staleness.mode=on_policy", "train.steps=2"))  # 16 groups: every variant at least twice
    assert proc.returncode == 0, _explain(proc)
    rows = step_rows(tmp_path / "bad")
    assert len(rows) == 2, rows
    check_accounting(rows)
    for reason in ("bad_mask", "rejected", "missing_versions", "timeout", "error", "empty", "missing_logprobs"):
        assert total(rows, f"rollout_fn/dropped/{reason}") > 0, (reason, rows)
    for reason in ("bad_result", "bad_tokens", "too_long", "aborted"):
        assert total(rows, f"rollout_fn/dropped/{reason}") == 0, (reason, rows)
    # the ledger counts them all as bad_rollout (on_policy: in the step that generated them)
    for r in rows:
        assert r["samples/dropped"] == r["samples/dropped/bad_rollout"], r
    assert rows[-1]["samples/dropped/bad_rollout"] == sum(total(rows, k) for k in {
        k for r in rows for k in r if k.startswith("rollout_fn/dropped/")})
    assert total(rows, "samples/dropped_this_step") > 0
    # the good groups still train: there are per-episode numbers and a batch
    assert any(math.isfinite(r.get("rollout/custom/turns", float("nan"))) for r in rows), rows
    assert all(r["samples/consumed"] > 0 for r in rows)
    # the first few drops of each reason are printed with the field at fault; `rejected` is counted, not printed
    out = proc.stdout + proc.stderr
    (tmp_path / "out.txt").write_text(out)
    for reason in ("bad_mask", "missing_versions", "timeout", "error", "empty", "missing_logprobs"):
        assert f"dropped ({reason})" in out, (reason, _explain(proc))
    assert "feedback_plugin.py:mixed" in out and "the environment crashed" in out and "loss_mask has" in out
    assert "rejected" not in out, _explain(proc)


def test_config_refuses_non_async_function():
    proc = m2po("config", "tiny-cpu", "--no-check-files", f"rollout.function={PLUGIN}:not_async", timeout=300)
    assert proc.returncode == 2, _explain(proc)
    assert "rollout.function" in proc.stdout + proc.stderr, _explain(proc)
