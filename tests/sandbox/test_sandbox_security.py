"""Attacks on the code reward's sandbox, run for real through bubblewrap: each is contained, scores as a
failure with its reason, ends within the test's time limit, and leaves the machine as it was (host files,
a sentinel process, no stray sandbox processes)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from m2po_megatron.reward.code import code_reward
from m2po_megatron.sandbox import Limits, run_sandboxed, sandbox_status

pytestmark = pytest.mark.timeout(60)

MARK = b"m2po-sandbox"  # on the command line of every process a sandboxed run starts (the launcher's text)


@pytest.fixture(scope="module", autouse=True)
def _sandbox():
    st = sandbox_status()
    if not st.ok:
        pytest.fail(f"bubblewrap sandbox unavailable: {st.detail}")


def _marked(marker: bytes) -> list[int]:
    pids = []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == os.getpid():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if marker in f.read():
                    pids.append(int(p))
        except OSError:  # gone meanwhile
            pass
    return pids


def _wait_gone(marker: bytes) -> list[int]:
    """Processes still carrying `marker` after the kernel has had time to tear a killed sandbox down (a pid
    namespace dies asynchronously after its init); the test's own timeout bounds the wait."""
    while True:
        left = _marked(marker)
        if not left:
            return []
        time.sleep(0.05)
        if time.monotonic() > _wait_gone.deadline:
            return left


@pytest.fixture(autouse=True)
def no_strays():
    yield
    _wait_gone.deadline = time.monotonic() + 20
    assert _wait_gone(MARK) == [], "sandbox processes survived the run"


def reward(code: str, tests, **args) -> dict:
    return code_reward(f"```python\n{code}\n```", [], {"tests": tests}, **args)


def one_case(expected: str, inp: str = "") -> list[dict]:
    return [{"input": inp, "output": expected}]


def failed_with(out: dict, reason: str) -> bool:
    return out["score"] == 0.0 and out[reason] == 1.0


def test_cannot_read_host_files(tmp_path):
    secret = f"secret-{uuid.uuid4().hex}"
    path = tmp_path / "secret.txt"
    path.write_text(secret)
    os.chmod(tmp_path, 0o755)
    os.chmod(path, 0o644)  # readable by anyone who can see it: only the mount view protects it
    code = f"print(open({str(path)!r}).read())"
    assert failed_with(reward(code, one_case(secret)), "runtime_error")
    probe = ("import os\nfor p in ['/etc', '/home', '/work', '/var', {d!r}]:\n"
             "    print(p, os.path.exists(p))\n"
             "print(os.listdir('/root') if os.path.exists('/root') else [])\n").format(d=str(tmp_path))
    res = run_sandboxed({"main.py": probe.encode()}, "main.py", b"", Limits(timeout_s=10))
    assert res.reason == "ok", res.stderr_tail
    *exists, in_root = res.stdout.decode().splitlines()
    assert all(line.endswith("False") for line in exists), res.stdout
    # /root holds at most the directories leading to the interpreter's installation (pyenv lives there)
    prefix = os.path.realpath(sys.base_prefix)
    allowed = [prefix.split("/")[2]] if prefix.startswith("/root/") else []
    assert eval(in_root) in ([], allowed)
    assert secret.encode() not in res.stdout + res.stderr_tail.encode()


def test_cannot_write_outside(tmp_path):
    os.chmod(tmp_path, 0o777)  # writable by anyone who can reach it
    targets = [str(tmp_path / "pwned"), "/root/pwned-m2po", "/etc/pwned-m2po", "/usr/pwned-m2po",
               "/sandbox/main.py"]
    code = ("import os\nfor t in {t!r}:\n    try:\n        open(t, 'w').write('x'); print('wrote', t)\n"
            "    except OSError as e: print('denied', t, e.errno)\n").format(t=targets)
    out = reward(code, one_case("\n".join(f"wrote {t}" for t in targets)))
    assert failed_with(out, "wrong_answer")
    for t in targets[:4]:
        assert not os.path.exists(t)
    assert os.listdir(tmp_path) == []


def test_no_network():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    try:
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
                f"print('connected')")
        assert failed_with(reward(code, one_case("connected")), "runtime_error")
        code2 = "import socket\nprint(socket.getaddrinfo('example.com', 80))"
        assert failed_with(reward(code2, one_case("x")), "runtime_error")
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever arrived
    finally:
        listener.close()


def test_fork_bomb_is_bounded():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    assert failed_with(reward(bomb, one_case("done"), timeout_s=1.0, max_processes=8), "timeout")
    counter = ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
               "            time.sleep(30); os._exit(0)\n        n += 1\nexcept OSError as e:\n    print(n, e.errno)\n")
    res = run_sandboxed({"main.py": counter.encode()}, "main.py", b"", Limits(timeout_s=10, max_processes=8))
    forked, errno = map(int, res.stdout.split())
    assert 1 <= forked <= 7 and errno == 11  # EAGAIN: the program itself is one of the 8


def test_runs_unprivileged_with_bounded_disk():
    code = ("import os\ncaps = open('/proc/self/status').read().split('CapEff:')[1].split()[0]\n"
            "print(os.getuid(), os.geteuid(), caps)\n"
            "for d in ('/', '/dev/shm', '/sandbox', '/usr'):\n    try:\n        open(d + '/fill', 'w')\n"
            "        print('wrote', d)\n    except OSError:\n        pass\n"
            "total = 0\ntry:\n    for i in range(1000):\n        with open(f'/tmp/f{i}', 'wb') as f:\n"
            "            for _ in range(8):\n                f.write(b'x' * (1 << 20)); total += 1\n"
            "except OSError as e:\n    print('full', total, e.errno)\n")
    res = run_sandboxed({"main.py": code.encode()}, "main.py", b"", Limits(timeout_s=20, tmpfs_mb=32))
    assert res.reason == "ok", res.stderr_tail
    ids, full = res.stdout.decode().splitlines()
    uid, euid, caps = ids.split()
    assert uid == euid != "0" and int(caps, 16) == 0  # no root, no capabilities
    _, mb, errno = full.split()
    assert int(mb) <= 32 and int(errno) == 28  # ENOSPC: /tmp is the only writable place, and it is bounded


def test_memory_bomb():
    code = "x = []\nwhile True:\n    x.append(bytearray(64 << 20))\n"
    assert failed_with(reward(code, one_case("done"), memory_mb=256), "memory")


def test_endless_loop():
    assert failed_with(reward("while True:\n    pass", one_case("done"), timeout_s=1.0), "timeout")
    # sleeping uses no CPU: the wall clock limit, enforced from outside, ends it
    assert failed_with(reward("import time\ntime.sleep(600)", one_case("done"), timeout_s=1.0), "timeout")


def test_output_flood_is_capped():
    code = "import sys\nwhile True:\n    sys.stdout.write('y' * 65536)\n"
    assert failed_with(reward(code, one_case("y"), max_output_bytes=100_000), "output_limit")
    res = run_sandboxed({"main.py": code.encode()}, "main.py", b"", Limits(timeout_s=10, max_output_bytes=100_000))
    assert res.reason == "output_limit" and len(res.stdout) <= 100_000
    err = "import sys\nwhile True:\n    sys.stderr.write('e' * 65536)\n"
    res = run_sandboxed({"main.py": err.encode()}, "main.py", b"", Limits(timeout_s=10, max_output_bytes=100_000))
    assert res.reason == "output_limit" and len(res.stderr_tail) <= 4096


def test_cannot_signal_outside():
    sentinel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        code = (f"import os, signal\nfor f in (lambda: os.kill(os.getppid(), signal.SIGKILL),\n"
                f"          lambda: os.kill({sentinel.pid}, signal.SIGKILL),\n"
                f"          lambda: os.kill({os.getpid()}, signal.SIGKILL),\n"
                f"          lambda: os.killpg(0, signal.SIGKILL),\n"
                f"          lambda: os.kill(-1, signal.SIGKILL)):\n"
                f"    try:\n        f()\n    except OSError:\n        pass\nprint('survived')\n")
        out = reward(code, one_case("killed everything"))
        assert out["score"] == 0.0
        assert sentinel.poll() is None  # the sibling lives (and so do we: this line runs)
    finally:
        sentinel.kill()
        sentinel.wait()


def test_ctypes_escapes(tmp_path):
    os.chmod(tmp_path, 0o777)
    target = tmp_path / "via-syscall"
    sentinel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    code = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
results = {{}}
results["kill"] = libc.kill({sentinel.pid}, 9)
results["mount"] = libc.mount(b"none", b"/usr", b"tmpfs", 0, None)
results["unshare"] = libc.unshare(0x10000000 | 0x00020000)  # CLONE_NEWUSER | CLONE_NEWNS
results["setuid"] = libc.setuid(0)
results["ptrace"] = libc.ptrace(16, 1, None, None)  # PTRACE_ATTACH to pid 1
results["open"] = libc.open({str(target).encode()!r}, os.O_WRONLY | os.O_CREAT, 0o666)
results["chroot"] = libc.chroot(b"/tmp")
print(sorted(results.items()))
"""
    try:
        res = run_sandboxed({"main.py": code.encode()}, "main.py", b"", Limits(timeout_s=10))
        assert res.reason == "ok", res.stderr_tail
        results = dict(eval(res.stdout.decode()))  # our own program's repr of a list of (str, int)
        assert all(v == -1 for v in results.values()), results
        assert failed_with(reward(code, one_case("escaped")), "wrong_answer")
        assert sentinel.poll() is None
        assert not target.exists()
    finally:
        sentinel.kill()
        sentinel.wait()


def test_run_secrets_are_invisible(monkeypatch):
    secret = f"sk-{uuid.uuid4().hex}"
    monkeypatch.setenv("M2PO_API_KEY", secret)
    monkeypatch.setenv("SECRET_TOKEN", secret)
    code = ("import os\nprint(dict(os.environ))\nfor p in os.listdir('/proc'):\n    try:\n"
            "        print(p, open(f'/proc/{p}/environ', 'rb').read())\n    except OSError:\n        pass\n")
    res = run_sandboxed({"main.py": code.encode()}, "main.py", b"", Limits(timeout_s=10))
    assert res.reason == "ok"
    assert b"M2PO_API_KEY" not in res.stdout and secret.encode() not in res.stdout
    assert failed_with(reward(f"import os\nprint(os.environ.get('M2PO_API_KEY'))", one_case(secret)),
                       "wrong_answer")


FORGERIES = {
    "exit 0 early": "import sys\nsys.exit(0)",
    "os._exit(0)": "import os\nos._exit(0)",
    "fake PASS lines": "print('PASS')\nprint('All tests passed')\nprint('OK')",
    "patch builtins": ("import builtins, json\nbuiltins.print = lambda *a, **k: None\n"
                       "json.dumps = lambda *a, **k: '42'\nbuiltins.__import__ = None\n"),
    "edit the tests": ("import os\nfor d in ('/sandbox', '/tmp', '/', os.getcwd()):\n    for f in os.listdir(d):\n"
                       "        try: open(os.path.join(d, f), 'w').write('4')\n        except OSError: pass\n"
                       "open('/tmp/tests.json', 'w').write('{\"outputs\": []}')\n"),
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forged_verdicts_fail(name):
    out = reward(FORGERIES[name], one_case("4\n", "2 2\n"))
    assert out["score"] == 0.0 and out["passed"] == 0.0


def test_forged_function_results_fail():
    tests = {"inputs": [[2, 2]], "outputs": [[4]], "fn_name": "add"}
    always_equal = ("class Any:\n    def __eq__(self, o): return True\n    def __ne__(self, o): return False\n"
                    "def add(a, b):\n    return Any()\n")
    assert reward(always_equal, tests)["score"] == 0.0
    list_liar = ("class L(list):\n    def __eq__(self, o): return True\n"
                 "def add(a, b):\n    return L()\n")
    assert reward(list_liar, tests)["score"] == 0.0
    rigged = ("import json, sys\njson.dumps = lambda *a, **k: 'true'\n"
              "def add(a, b):\n    sys.__stdout__.write('PASS\\ntrue\\n'); sys.exit(0)\n")
    assert reward(rigged, tests)["score"] == 0.0
    assert reward("def add(a, b):\n    return a - b", tests)["score"] == 0.0


def test_killed_worker_takes_its_sandbox_along():
    tag = f"m2po-test-{uuid.uuid4().hex}"
    worker = subprocess.Popen([sys.executable, "-c", (
        "import sys\nfrom m2po_megatron.sandbox import Limits, run_sandboxed\n"
        f"run_sandboxed({{'main.py': b'import time\\ntime.sleep(120)'}}, 'main.py', b'', Limits(timeout_s=100), "
        f"tag={tag!r})\n")], cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        while len(_marked(tag.encode())) < 4:  # the worker, bwrap (2) and the launcher are up
            assert worker.poll() is None, "the worker died before its sandbox started"
            time.sleep(0.05)
        worker.kill()  # what the reward pool does to a worker past its time limit
        worker.wait()
        _wait_gone.deadline = time.monotonic() + 20
        assert _wait_gone(tag.encode()) == []
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
