"""A restart in a used run directory, a truncated checkpoint file, a malformed data file, a port that
another server holds: each is found before anything is written or Ray starts (exit 2, the field or file and
the fix named), or, for a damaged checkpoint, the run resumes from the latest intact one."""
import subprocess
from pathlib import Path

import pytest

from harness import (RUN_TIMEOUT, Driver, assert_accounting, assert_nothing_left, assert_steps_once, checkpoints,
                     rollout_port, small, step_rows)


def m2po_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """`m2po ARGS` in this process (`cli.main`), for a start that ends before Ray: a refusal (exit 2) or a
    finished run's "nothing to do". Saves a subprocess's imports; checks that Ray was never started."""
    import ray

    from m2po_megatron.cli import main

    capsys.readouterr()
    rc = main(list(args))
    out = capsys.readouterr()
    assert not ray.is_initialized(), "Ray was started"
    return subprocess.CompletedProcess(list(args), rc, out.out, out.err)


def tree(root: Path) -> dict:
    """Every file under root with its size and modification time: what "nothing was written" compares."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.is_file()}


def refused(p, *needles):
    assert p.returncode == 2, f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    assert "Traceback" not in p.stderr, p.stderr
    for n in needles:
        assert n in p.stderr, (n, p.stderr)


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_used_run_dir_is_refused_and_a_truncated_checkpoint_is_skipped(tiny_task, tmp_path, short_tmp, drivers,
                                                                        capsys):
    run = tmp_path / "u"
    args = small(tiny_task, tmp_path, "u", "staleness.mode=bounded", "staleness.max_staleness=2", "train.steps=3")
    d = Driver(["tiny-cpu", *args], tmp_path / "first.log", short_tmp)
    drivers.append(d)
    assert d.finish() == 0, d.output()[-5000:]
    assert checkpoints(run) == [1, 2, 3]
    before = tree(run)

    # a new run in the same directory: refused before anything is written, naming both ways forward
    refused(m2po_here(capsys, "train", "tiny-cpu", *args), "holds another run", "--resume auto", "--overwrite")
    # a start that fails on a bad data file leaves the old run as it was, even with --overwrite
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer"\n')
    refused(m2po_here(capsys, "train", "tiny-cpu", *args, f"data.train_path={bad}", "--overwrite"), f"{bad}:2", "not valid JSON")
    assert tree(run) == before

    # truncate the newest checkpoint's largest file: an explicit resume from it is refused naming the file;
    # --resume auto takes the latest intact one, says so, and the run continues from there
    step3 = run / "checkpoints" / "step_0000003"
    victim = max((p for p in step3.rglob("*") if p.is_file() and p.name != "COMPLETE"), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    refused(m2po_here(capsys, "train", "tiny-cpu", *args, "--resume", str(step3), "train.steps=4"), str(victim), "bytes")
    d = Driver(["tiny-cpu", *args, "--resume", "auto", "train.steps=4"], tmp_path / "resume.log", short_tmp)
    drivers.append(d)
    assert d.finish() == 0, d.output()[-5000:]
    assert f"checkpoint {step3} is damaged" in d.output() and str(victim) in d.output()
    assert "(step 2)" in d.output()
    assert_steps_once(run, [1, 2, 3, 4])
    assert_accounting(step_rows(run))
    assert_nothing_left(d, [rollout_port(run)])

    # a finished run resumed again: nothing to do, nothing started or changed
    before = tree(run)
    p = m2po_here(capsys, "train", "tiny-cpu", *args, "--resume", "auto", "train.steps=4")
    assert p.returncode == 0 and "is complete at step 4 (train.steps = 4); nothing to do" in p.stdout, p.stdout + p.stderr
    assert tree(run) == before

    # --overwrite starts over; the old run is moved aside whole, not deleted
    d = Driver(["tiny-cpu", *args, "--overwrite", "train.steps=1"], tmp_path / "over.log", short_tmp)
    drivers.append(d)
    assert d.finish() == 0, d.output()[-5000:]
    (old,) = tmp_path.glob("u.replaced-*")
    assert f"moved to {old}" in d.output()
    assert {k: v for k, v in tree(old).items() if k != ".lock"} == {k: v for k, v in before.items() if k != ".lock"}
    assert_steps_once(run, [1])
    assert_nothing_left(d, [rollout_port(run)])


@pytest.mark.parametrize("content, needle", [
    ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"\n', ":2: not valid JSON"),
    ("", "no rows"),
    ('{"prompt": "1+1="}\n', ":1: column 'answer' (data.label_key): missing or empty"),
    ('["not", "an", "object"]\n', ":1: not an object but a list"),
    ('{"prompt": "' + "1+" * 200 + '1=", "answer": "2"}\n', "data.max_prompt_len"),
    (b"\xff\xfe\x00garbage", "cannot read it"),
], ids=["bad-json", "empty", "no-answer", "not-object", "too-long", "binary"])
def test_a_malformed_data_file_fails_before_ray_naming_file_and_line(tiny_task, tmp_path, capsys, content, needle):
    """In this process (the subprocess path of a bad file is in the test above): `m2po train` returns 2 with
    the message, writes nothing and never starts Ray."""
    import ray

    from m2po_megatron.cli import main

    data = tmp_path / "train.jsonl"
    data.write_bytes(content if isinstance(content, bytes) else content.encode())
    out = tmp_path / "runs"
    rc = main(["train", "tiny-cpu", *small(tiny_task, out, "m", f"data.train_path={data}")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    for n in ("data.train_path", str(data), needle):
        assert n in err, (n, err)
    assert not out.exists()  # nothing written
    assert not ray.is_initialized()


def test_a_fixed_port_held_by_another_server_is_refused_and_a_foreign_server_is_never_used(tiny_task, tmp_path,
                                                                                          capsys):
    from m2po_megatron.rollout.launcher import ForeignServerError, ServerProcess, ServerSpec, check_identity, wait_healthy

    other = ServerProcess(ServerSpec(model_path=str(tiny_task), served_model_name="m2po-other-run"),
                          str(tmp_path / "other.log"), max_restarts=0, health_timeout_s=RUN_TIMEOUT)
    try:
        url = other.start()
        port = other.spec.port
        # a run given that port explicitly stops before Ray starts
        p = m2po_here(capsys, "train", "tiny-cpu", *small(tiny_task, tmp_path, "p", f"rollout.port={port}"))
        refused(p, f"port {port}", "rollout.port=0")
        # a server that answers at a URL but carries another run's identity is never taken for ours
        with pytest.raises(ForeignServerError, match="m2po-other-run"):
            check_identity(url, "m2po-this-run")
        with pytest.raises(ForeignServerError):
            wait_healthy(url, timeout_s=RUN_TIMEOUT, served_model_name="m2po-this-run")
        check_identity(url, "m2po-other-run")  # its own run would use it
    finally:
        other.stop()
    assert other.proc.poll() is not None
    # stopped, the port is free again: nothing of the server is left
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
