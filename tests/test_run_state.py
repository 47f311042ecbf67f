"""run_state: atomic checkpoint dirs, keep-last, resume resolution, run-state file, RNG, SIGTERM flag."""
import json
import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from m2po_megatron.run.state import (
    MARKER,
    CheckpointManager,
    RunStateError,
    capture_rng_state,
    StopNow,
    install_sigterm_flag,
    load_run_state,
    restore_rng_state,
    save_run_state,
)


def _save(mgr: CheckpointManager, step: int, payload: str = "w") -> None:
    tmp = mgr.begin(step)
    (tmp / "model").mkdir()
    (tmp / "model" / "weights.bin").write_text(payload * 100)
    save_run_state(tmp / "run_state.json", {"step": step})
    mgr.commit(step)


def test_commit_publishes_a_complete_dir(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=3)
    assert mgr.latest() is None
    _save(mgr, 7)
    final = mgr.latest()
    assert final == tmp_path / "ckpt" / "step_0000007"
    assert (final / MARKER).is_file() and (final / "model" / "weights.bin").is_file()
    assert load_run_state(final / "run_state.json") == {"step": 7}
    assert not mgr.tmp_dir(7).exists()


def test_crash_mid_write_is_ignored(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    _save(mgr, 10)
    # a crash while writing step 20: its temp dir holds files but was never committed
    tmp = mgr.begin(20)
    (tmp / "half.bin").write_text("x")
    # a step dir without the marker (e.g. copied by hand, or written by something else)
    (tmp_path / "step_0000030").mkdir()
    (tmp_path / "step_0000030" / "weights.bin").write_text("x")
    with pytest.warns(UserWarning, match="no COMPLETE marker"):
        assert mgr.latest() == mgr.step_dir(10)
    with pytest.warns(UserWarning):
        assert mgr.resolve_resume("auto") == mgr.step_dir(10)
    # restarting the same step removes the leftover
    assert not (mgr.begin(20) / "half.bin").exists()


def test_crash_between_marker_and_rename(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path, keep_last=0)
    _save(mgr, 1)
    tmp = mgr.begin(2)
    (tmp / "w").write_text("x")

    def boom(*a, **k):
        raise OSError("simulated crash")

    monkeypatch.setattr(os, "rename", boom)
    with pytest.raises(OSError, match="simulated crash"):
        mgr.commit(2)
    monkeypatch.undo()
    assert (tmp / MARKER).exists()  # marked, but still under its temporary name
    assert mgr.latest() == mgr.step_dir(1)
    _save(mgr, 3)  # a later commit cleans the stale temp dir of step 2
    assert not tmp.exists() and mgr.complete_steps() == [1, 3]


def test_crash_in_a_real_process_leaves_previous_checkpoint(tmp_path):
    mgr = CheckpointManager(tmp_path)
    _save(mgr, 5)
    code = textwrap.dedent(f"""
        import os
        from m2po_megatron.run.state import CheckpointManager
        mgr = CheckpointManager({str(tmp_path)!r})
        tmp = mgr.begin(6)
        with open(tmp / "big.bin", "wb") as f:
            f.write(b"x" * 1000)
            f.flush()
            os.kill(os.getpid(), 9)
    """)
    r = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert r.returncode == -9
    assert mgr.tmp_dir(6).exists() and mgr.latest() == mgr.step_dir(5)


def test_keep_last(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for s in range(0, 50, 10):
        _save(mgr, s)
    assert mgr.complete_steps() == [30, 40]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000030", "step_0000040"]
    keep_all = CheckpointManager(tmp_path / "all", keep_last=0)
    for s in range(4):
        _save(keep_all, s)
    assert keep_all.complete_steps() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="keep_last = -1"):
        CheckpointManager(tmp_path, keep_last=-1)


def test_recommit_replaces(tmp_path):
    mgr = CheckpointManager(tmp_path)
    _save(mgr, 4, payload="a")
    _save(mgr, 4, payload="b")
    assert (mgr.step_dir(4) / "model" / "weights.bin").read_text() == "b" * 100
    assert [p.name for p in tmp_path.iterdir()] == ["step_0000004"]


def test_commit_without_begin(tmp_path):
    with pytest.raises(RunStateError, match=r"call begin\(3\)"):
        CheckpointManager(tmp_path).commit(3)


def test_resolve_resume(tmp_path):
    mgr = CheckpointManager(tmp_path / "ckpt")
    assert mgr.resolve_resume("none") is None and mgr.resolve_resume(None) is None
    assert mgr.resolve_resume("auto") is None  # nothing yet: start fresh
    _save(mgr, 2)
    _save(mgr, 3)
    assert mgr.resolve_resume("auto") == mgr.step_dir(3)
    assert mgr.resolve_resume(str(mgr.step_dir(2))) == mgr.step_dir(2)
    other = CheckpointManager(tmp_path / "elsewhere")
    assert other.resolve_resume(tmp_path / "ckpt") == mgr.step_dir(3)  # a root: its latest
    with pytest.raises(RunStateError, match="no such checkpoint"):
        mgr.resolve_resume(tmp_path / "missing")
    (tmp_path / "partial").mkdir()
    with pytest.raises(RunStateError, match="not a complete checkpoint"):
        mgr.resolve_resume(tmp_path / "partial")


def test_manifest_finds_a_truncated_or_missing_file_and_auto_skips_the_damaged(tmp_path, capsys):
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=0)
    for s in (1, 2, 3):
        _save(mgr, s)
    assert all(mgr.verify(mgr.step_dir(s)) == [] for s in (1, 2, 3))
    weights = mgr.step_dir(3) / "model" / "weights.bin"
    weights.write_text("w" * 10)  # a truncated copy
    assert mgr.verify(mgr.step_dir(3)) == [f"{weights} has 10 bytes, 100 were written"]
    (mgr.step_dir(2) / "run_state.json").unlink()
    assert mgr.verify(mgr.step_dir(2)) == [f"{mgr.step_dir(2) / 'run_state.json'} is missing"]
    assert mgr.resolve_resume("auto") == mgr.step_dir(1)  # the latest intact one
    err = capsys.readouterr().err
    assert f"checkpoint {mgr.step_dir(3)} is damaged" in err and f"checkpoint {mgr.step_dir(2)} is damaged" in err
    with pytest.raises(RunStateError, match=r"weights.bin has 10 bytes"):  # an explicit path: refused
        mgr.resolve_resume(mgr.step_dir(3))
    (mgr.step_dir(1) / MARKER).write_text("{garbage")
    with pytest.raises(RunStateError, match="every checkpoint under .* is damaged"):
        mgr.resolve_resume("auto")


def test_retention_never_drops_a_newer_checkpoint_for_an_older_one(tmp_path):
    """A run resumed from step 2 of a directory that also holds step 5 (another timeline) commits step 3
    with keep_last=1: step 3 stays; step 5 is never a reason to delete it, and retire_newer moves step 5
    aside so that --resume auto continues this run."""
    mgr = CheckpointManager(tmp_path, keep_last=1)
    for s in (2, 5):
        _save(mgr, s)
        if s == 2:
            mgr.keep_last = 0
    mgr.keep_last = 1
    moved = mgr.retire_newer(2)
    assert [p.name.split(".")[0] for p in moved] == ["step_0000005"] and moved[0].exists()
    _save(mgr, 3)
    assert mgr.complete_steps() == [3] and mgr.resolve_resume("auto") == mgr.step_dir(3)
    _save(mgr, 9)  # without retiring: the just-committed step always survives its own pruning
    _save(CheckpointManager(tmp_path, keep_last=0), 12)
    mgr._prune(10)
    assert mgr.complete_steps() == [9, 12]


def test_run_state_round_trip_with_rng(tmp_path):
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    rng = capture_rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    state = {"step": 12, "version": 48, "data_position": 3072, "rng": rng,
             "staleness": {"running": [["g1", 40]], "finished": [[5, 44]]}, "queued_batches": ["/x/b0.pt"],
             "in_flight_prompts": [101, 102], "counters": {"samples/generated": 10}, "loss": float("nan")}
    save_run_state(tmp_path / "rs.json", state)
    random.random(), np.random.rand(), torch.rand(1)  # move all generators on
    back = load_run_state(tmp_path / "rs.json")
    assert back["staleness"] == state["staleness"] and back["step"] == 12 and back["loss"] != back["loss"]
    restore_rng_state(back["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_corrupt_and_partial_run_state(tmp_path):
    p = tmp_path / "rs.json"
    save_run_state(p, {"step": 1, "queue": list(range(50))})
    text = p.read_text()
    p.write_text(text[: len(text) // 2])  # truncated, as by a crash without the atomic rename
    with pytest.raises(RunStateError, match="corrupt or partially written"):
        load_run_state(p)
    p.write_text(text.replace('"step": 1', '"step": 2'))
    with pytest.raises(RunStateError, match="checksum mismatch"):
        load_run_state(p)
    doc = json.loads(text)
    doc["schema_version"] = 99
    p.write_text(json.dumps(doc))
    with pytest.raises(RunStateError, match="schema version 99"):
        load_run_state(p)
    p.write_text("[1, 2]")
    with pytest.raises(RunStateError, match="not an m2po run-state file"):
        load_run_state(p)
    with pytest.raises(RunStateError, match="does not exist"):
        load_run_state(tmp_path / "nope.json")


def test_unserialisable_state_names_the_key(tmp_path):
    with pytest.raises(TypeError, match=r"state.queue\[1\]: Tensor is not JSON-serialisable"):
        save_run_state(tmp_path / "rs.json", {"queue": [1, torch.zeros(2)]})
    with pytest.raises(TypeError, match="key 3 is int"):
        save_run_state(tmp_path / "rs.json", {"counts": {3: 1}})
    assert not list(tmp_path.iterdir())  # nothing written


def test_sigterm_flag_in_process():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)
    flag = install_sigterm_flag()
    try:
        assert not flag.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.requested and flag.signal_name == "SIGUSR1"
        with pytest.raises(StopNow, match="second SIGTERM") as e:  # a second signal: leave now
            os.kill(os.getpid(), signal.SIGTERM)
        assert e.value.signum == signal.SIGTERM and flag.signal_name == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)  # a third, while leaving, changes nothing
    finally:
        flag.restore()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR1)) == before


@pytest.mark.timeout(120)
def test_stop_timeout_interrupts_a_stuck_main_thread():
    """The first signal arms checkpoint.stop_timeout_s; past it the main thread gets StopNow even while it
    blocks (here on a lock nobody releases), so a stop that cannot finish still ends, promptly."""
    code = textwrap.dedent("""
        import os, signal, sys, threading
        from m2po_megatron.run.state import StopNow, install_sigterm_flag
        flag = install_sigterm_flag(timeout_s=0.5)
        os.kill(os.getpid(), signal.SIGTERM)
        try:
            threading.Event().wait()  # a step that never ends
        except StopNow as e:
            print("left:", e, flush=True)
            sys.exit(128 + e.signum)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert p.returncode == 128 + signal.SIGTERM, p.stderr
    assert "left: the stop did not finish within checkpoint.stop_timeout_s" in p.stdout, p.stdout


@pytest.mark.timeout(60)
def test_sigterm_lets_a_loop_checkpoint_and_exit(tmp_path):
    code = textwrap.dedent(f"""
        import sys, time
        from m2po_megatron.run.state import CheckpointManager, install_sigterm_flag, save_run_state
        flag = install_sigterm_flag()
        mgr = CheckpointManager({str(tmp_path)!r})
        print("ready", flush=True)
        step = 0
        while not flag.requested:
            step += 1
            time.sleep(0.01)
        tmp = mgr.begin(step)
        save_run_state(tmp / "run_state.json", {{"step": step, "signal": flag.signal_name}})
        mgr.commit(step)
        sys.exit(0)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "received SIGTERM" in err
    latest = CheckpointManager(tmp_path).latest()
    assert load_run_state(latest / "run_state.json")["signal"] == "SIGTERM"
