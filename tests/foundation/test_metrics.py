import io
import json
import os
import subprocess
import sys

import pytest

from m2po_megatron.run.metrics import MetricsLogger, Progress, read_metrics


def test_jsonl_rows_and_secret_keys_dropped(tmp_path):
    with MetricsLogger(tmp_path / "run", config={"rollout": {"api_key": "k"}}) as m:
        m.log({"reward/mean": 0.5, "loss": float("nan"), "api_key": "oops", "hf_token": "x",
               "tokens_per_s/gen": 3.0, "staleness/token_mean": 1.5}, step=1)
        m.log({"reward/mean": 0.75}, step=2)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["reward/mean"] == 0.5 and rows[0]["loss"] == "nan" and "api_key" not in rows[0]
    assert "hf_token" not in rows[0] and rows[0]["tokens_per_s/gen"] == 3.0 and rows[0]["staleness/token_mean"] == 1.5
    # resume appends; a fresh logger truncates
    with MetricsLogger(tmp_path / "run", resume=True) as m:
        m.log({"x": 1}, step=3)
    assert len(read_metrics(tmp_path / "run" / "metrics.jsonl")) == 3


def test_truncated_last_line_is_tolerated(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "rew')
    with pytest.warns(UserWarning, match="truncated last line"):
        assert read_metrics(p) == [{"step": 1}]
    p.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "rew\n' + json.dumps({"step": 3}) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: bad metrics line"):
        read_metrics(p)  # a corrupt line in the middle is never skipped silently


def test_wandb_offline_creates_run_dir(tmp_path):
    code = (
        "import sys; from m2po_megatron.run.metrics import MetricsLogger\n"
        "m = MetricsLogger(sys.argv[1], config={'rollout': {'api_key': 'sk-secret'}}, wandb_mode='offline')\n"
        "m.log({'reward/mean': 1.0}, step=1); m.close()\n"
    )
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs, list(tmp_path.rglob("*"))
    blobs = [f.read_bytes() for f in tmp_path.rglob("*") if f.is_file()]
    assert any(b"reward/mean" in f.read_bytes() for f in runs[0].glob("*.wandb"))
    assert not any(b"sk-secret" in b for b in blobs)  # the config reached wandb redacted


def test_progress_plain_output_is_line_based():
    buf = io.StringIO()
    with Progress(5, "steps", stream=buf, min_interval_s=0.0) as p:
        for _ in range(5):
            p.update(postfix="reward 0.5")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 5 and "\r" not in buf.getvalue() and "\x1b" not in buf.getvalue()
    assert lines[-1].startswith("steps 5/5 (100%)") and "eta" in lines[-1] and "reward 0.5" in lines[-1]


def test_progress_throttles_in_ci():
    buf = io.StringIO()
    p = Progress(100, "x", stream=buf, min_interval_s=3600)
    for _ in range(100):
        p.update()
    assert len(buf.getvalue().splitlines()) == 2  # the first update and the final one


def test_progress_of_a_resumed_run_counts_from_its_step():
    buf = io.StringIO()
    with Progress(16, "train", stream=buf, min_interval_s=0.0, initial=4) as p:
        p.update()
    assert buf.getvalue().splitlines()[-1].startswith("train 5/16 (31%)")
