"""The guardian that reclaims a run's processes and private Ray temp dir when its driver ends, however
it ends (kill -9 included), and the cleanup of a dead driver's leftovers at the next start."""
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from m2po_megatron.infra import reaper

DEADLINE = 60  # failure timeout only: the guardian acts on the driver's death, not on a timer


def _alive(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _until(cond, what):
    deadline = time.monotonic() + DEADLINE
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@pytest.mark.timeout(180)
def test_kill9_of_the_driver_reaps_its_processes_and_temp_dir(tmp_path):
    """A stand-in driver: a private temp dir, the guardian, a child in its own session (as Ray's agents
    and the rollout servers are) and a process that renamed itself but keeps a file open in the session
    dir (as Ray's agents do). kill -9 of the driver takes all of them and the temp dir."""
    driver = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, subprocess, sys, tempfile, time
        from m2po_megatron.infra import reaper
        token = reaper.new_token()
        tmp = tempfile.mkdtemp(prefix=reaper.PREFIX, dir={str(tmp_path)!r})
        reaper.write_owner(tmp, token, owned=True)
        session = os.path.join(tmp, "session_x_%d" % os.getpid())
        os.makedirs(session)
        g = reaper.Reaper(token, tmp, delete_tmpdir=True)
        child = subprocess.Popen(["sleep", "600"], start_new_session=True)
        agent = subprocess.Popen(["bash", "-c", "exec 3>{{}}/agent.log; exec sleep 600".format(session)],
                                 env={{"PATH": os.environ["PATH"]}}, start_new_session=True)
        print(tmp, child.pid, agent.pid, g.proc.pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        tmp, child, agent, guardian = driver.stdout.readline().split()
        child, agent, guardian = int(child), int(agent), int(guardian)
        _until(lambda: Path(tmp, f"session_x_{driver.pid}", "agent.log").exists(), "the agent's log file")
        assert _alive(child) and _alive(agent) and _alive(guardian)
        driver.kill()
        driver.wait(timeout=DEADLINE)
        _until(lambda: not (_alive(child) or _alive(agent) or _alive(guardian)), "the run's processes to go")
        assert not Path(tmp).exists()
    finally:
        if driver.poll() is None:
            driver.kill()


@pytest.mark.timeout(120)
def test_the_next_start_cleans_a_dead_drivers_temp_dir(tmp_path):
    """The guardian itself was killed too: clean_stale (called by init_ray) kills what still carries the
    dead driver's token and removes its temp dir; a live driver's dir is left alone."""
    token = "stale-" + os.urandom(4).hex()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = Path(tempfile.mkdtemp(prefix=reaper.PREFIX, dir=tmp_path))
    (stale / reaper.OWNER_FILE).write_text(f'{{"pid": {dead.pid}, "start": 1, "token": "{token}", "delete": true}}')
    orphan = subprocess.Popen(["sleep", "600"], env={"PATH": os.environ["PATH"], reaper.TOKEN_ENV: token})
    live = Path(tempfile.mkdtemp(prefix=reaper.PREFIX, dir=tmp_path))
    reaper.write_owner(str(live), "live-token", owned=True)  # this process: alive
    try:
        assert reaper.clean_stale(str(tmp_path)) == [str(stale)]
        orphan.wait(timeout=DEADLINE)
        assert not stale.exists() and live.exists()
    finally:
        if orphan.poll() is None:
            orphan.kill()
