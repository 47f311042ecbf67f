"""The run directory's rules: one process at a time, no clobbering, metrics that end at the checkpoint."""
import json
import subprocess
import sys
import textwrap

import pytest

from m2po_megatron.config import ConfigError
from m2po_megatron.run.rundir import RunDirLock, describe_run, move_aside, refuse_if_used, truncate_metrics


def _run(tmp_path, rows=3):
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.yaml").write_text("run: {}\n")
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": s}) + "\n" for s in range(rows + 1)))
    (d / "checkpoints" / "step_0000002").mkdir(parents=True)
    return d


def test_a_used_directory_is_described_and_refused(tmp_path):
    assert describe_run(tmp_path / "nothing") is None
    refuse_if_used(tmp_path / "nothing")  # fresh: fine
    d = _run(tmp_path)
    assert describe_run(d) == "metrics.jsonl with 4 rows (last step 3), checkpoints step_0000002, config.yaml"
    with pytest.raises(ConfigError, match=r"holds another run .*`--resume auto`.*`--overwrite`"):
        refuse_if_used(d)


def test_overwrite_moves_the_old_run_aside(tmp_path):
    d = _run(tmp_path)
    moved = move_aside(d)
    assert not d.exists() and moved.name.startswith("run.replaced-")
    assert (moved / "metrics.jsonl").read_text().count("\n") == 4  # kept, not deleted


def test_truncate_metrics_keeps_the_checkpoints_steps(tmp_path):
    d = _run(tmp_path, rows=5)
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # a row cut by a kill
    assert truncate_metrics(d / "metrics.jsonl", 3) == 3
    assert [json.loads(x)["step"] for x in (d / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    assert truncate_metrics(d / "metrics.jsonl", 3) == 0  # idempotent
    assert truncate_metrics(d / "metrics.jsonl", 0) == 4  # no checkpoint: step 0 is evaluated again
    assert (d / "metrics.jsonl").read_text() == ""


@pytest.mark.timeout(120)
def test_the_lock_admits_one_process_and_dies_with_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from m2po_megatron.run.rundir import RunDirLock
        RunDirLock({str(tmp_path)!r}).acquire()
        print("held", flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"in use by another m2po process \\(pid {holder.pid}\\)"):
            RunDirLock(tmp_path).acquire()
    finally:
        holder.kill()  # like kill -9 of a driver: the kernel drops the lock
        holder.wait(timeout=60)
    RunDirLock(tmp_path).acquire().release()
