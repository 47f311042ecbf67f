"""`m2po preflight` on CPU: its gloo, Ray and CPU-server paths end to end in one command run, with one check
broken on purpose (the model path) so that a failure's named cause and fix and the exit code are checked too;
and the summary's pure parts (exit code, table, JSON) and bad input, in-process."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from m2po_megatron.cli import main
from m2po_megatron.preflight.checks import CHECKS, Result
from m2po_megatron.preflight.summary import document, exit_code, table


@pytest.mark.timeout(260)
def test_cpu_paths_end_to_end_with_a_broken_model_path(tmp_path):
    key = "pf-secret-key-1234567890"
    out = tmp_path / "summary.json"
    env = {**os.environ, "M2PO_API_KEY": key}
    proc = subprocess.run(
        [sys.executable, "-m", "m2po_megatron.cli", "preflight", "tiny-cpu", f"run.output_dir={tmp_path / 'runs'}",
         f"model.hf_path={tmp_path / 'no-such-model'}", "--json", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text
    doc = json.loads(out.read_text())
    by = {c["name"]: c for c in doc["checks"]}
    assert [c["name"] for c in doc["checks"]] == list(CHECKS)
    assert {n: c["status"] for n, c in by.items()} == {
        "ray": "ok", "comm": "ok", "te": "skipped", "engine": "ok", "memory": "fail"}, text
    assert doc["passed"] is False and doc["device"] == "cpu"
    # the collectives ran over gloo between two ranks and measured something
    assert by["comm"]["numbers"]["backend"] == "gloo" and by["comm"]["numbers"]["ranks"] == 2
    assert by["comm"]["numbers"]["all_reduce_busbw_gb_s"] > 0 and by["comm"]["numbers"]["broadcast_gb_s"] > 0
    # the server took the update over the distributed path, and its tokens show the new weights
    eng = by["engine"]["numbers"]
    assert eng["transport"] == "update_weights_from_distributed" and eng["backend"] == "gloo"
    assert eng["weight_version"] == "preflight-1" and len(set(eng["tokens_after"])) == 1
    assert eng["tokens_after"] != eng["tokens_before"]
    assert eng["server_host"] not in ("0.0.0.0", "", "::")
    assert by["ray"]["numbers"]["trainer_ranks"] == 1 and by["ray"]["numbers"]["servers_placed"] == 1
    assert "GPU" in by["te"]["cause"]
    # the broken check names its cause and its fix, in the JSON and the table
    mem = by["memory"]
    assert "config.json" in mem["cause"] and "no-such-model" in mem["cause"]
    assert "m2po download" in mem["fix"]
    assert "memory: FAILED" in proc.stdout and "fix: download the weights" in proc.stdout
    assert key not in text and key not in out.read_text()  # the servers' API key is never printed
    # every check's time stays inside its limit
    assert all(c["seconds"] <= c["limit_s"] for c in doc["checks"])


def _r(name, status, **kw):
    return Result(name, status, kw.pop("seconds", 1.0), kw.pop("limit_s", 60.0), **kw)


def test_exit_code_and_document_count_failures_not_skips():
    ok = [_r("ray", "ok", numbers={"nodes": 2}), _r("te", "skipped", cause="no GPU")]
    assert exit_code(ok) == 0 and exit_code([]) == 0
    bad = ok + [_r("comm", "fail", cause="slow link", fix="set NCCL_SOCKET_IFNAME")]
    assert exit_code(bad) == 1
    doc = document(bad, recipe="r.yaml", device="cpu", ray_address=None)
    assert doc["counts"] == {"ok": 1, "fail": 1, "skipped": 1} and doc["passed"] is False
    assert json.loads(json.dumps(doc))["checks"][2]["fix"] == "set NCCL_SOCKET_IFNAME"


def test_a_failure_must_name_cause_and_fix_and_statuses_are_known():
    with pytest.raises(ValueError, match="cause and its fix"):
        _r("comm", "fail", cause="x")
    with pytest.raises(ValueError, match="status"):
        _r("comm", "warn")


def test_table_shows_numbers_causes_fixes_and_the_verdict():
    res = [_r("comm", "ok", numbers={"backend": "nccl", "all_reduce_busbw_gb_s": 41.234567, "hosts": ["a"],
                                     "server_log": "/a/very/long/path/that/belongs/only/in/the/json.log"}),
           _r("te", "skipped", cause="no GPU here"),
           _r("engine", "fail", seconds=12.0, limit_s=420.0, cause="port 30000 is taken", fix="rollout.port=0")]
    text = table(res)
    lines = text.splitlines()
    assert lines[0].split() == ["check", "status", "time", "measured"]
    assert "backend=nccl, all_reduce_busbw_gb_s=41.2" in text and "hosts" not in text and "long/path" not in text
    assert "12/420 s" in text and "FAIL" in lines[4]
    assert "engine: FAILED: port 30000 is taken" in text and "fix: rollout.port=0" in text
    assert "te: skipped: no GPU here" in text
    assert lines[-1] == "preflight: FAILED (engine): 1 ok, 1 failed, 1 skipped"
    assert table([_r("ray", "ok")]).splitlines()[-1] == "preflight: passed: 1 ok, 0 failed, 0 skipped"


def test_bad_input_exits_2_before_any_check(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["preflight", "--only", "comm,nccl"]) == 2
    assert "unknown check(s) ['nccl']" in capsys.readouterr().err
    assert main(["preflight", "no-such-recipe"]) == 2
    assert "no-such-recipe" in capsys.readouterr().err
    assert main(["preflight", "--timeout-scale", "0"]) == 2
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written
