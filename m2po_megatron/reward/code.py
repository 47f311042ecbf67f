"""The built-in `code` reward: run the response's Python program against the row's test cases in a bubblewrap
sandbox (m2po_megatron.sandbox) and compare the outputs here, outside it.

Only the program and each case's input enter the sandbox; the expected outputs never do, so nothing the
program does (exit 0 early, patch builtins or ``__eq__``, print "PASS", touch files) can change the verdict.

Test cases (``row[args.tests_key]``, default "tests"; a JSON string of either form is accepted too):
- ``{"inputs": [...], "outputs": [...], "fn_name": optional}`` (APPS / TACO / LiveCodeBench style);
- ``[{"input": str, "output": str}, ...]`` (stdin/stdout).
Without fn_name the program runs once per case with the input on stdin; its stdout matches when the lines
are equal after collapsing runs of whitespace and dropping blank lines at the start and end. With fn_name, a
harness calls that function (top level, else a method of class ``Solution``) with the case's arguments and
prints the JSON of the result; it matches when it equals the expected value (JSON round trip, floats within
1e-6 relative), or the expected value's only element (APPS wraps results in a list).

Returns ``{"score", "passed", <reason>: 0/1 ...}``: score 1.0 only when every case passes (or the fraction
passed with ``partial: true``); ``passed`` the fraction of cases passed; one 0/1 entry per failure reason.
"""
from __future__ import annotations

import json
import math
import re
import sys
import threading
from dataclasses import dataclass, fields
from typing import Any, Optional

from m2po_megatron.sandbox import (FAILURE_REASONS, HOW_TO_GET_BWRAP, Limits, RunResult, run_sandboxed,
                                   run_unsandboxed, sandbox_status)

EXTRACT_MODES = ("last_block", "whole")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PY_LANGS = ("", "python", "py", "python3")

# Runs inside the sandbox next to the program (main.py) when the cases name a function. Untrusted code runs in
# its process and may do anything to it: it only ever produces the output that is judged outside.
_HARNESS = r'''
import json, os, sys
name = sys.argv[1]
args = json.loads(sys.stdin.read())
result_out = sys.stdout
sys.stdout = sys.stderr  # the program's own prints must not mix with the result
ns = {"__name__": "__solution__"}
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "main.py")
with open(path) as f:
    exec(compile(f.read(), path, "exec"), ns)
fn = ns.get(name)
if not callable(fn) and isinstance(ns.get("Solution"), type):
    fn = getattr(ns["Solution"](), name, None)
if not callable(fn):
    raise SystemExit(f"the program defines no function {name!r} (nor a method of class Solution)")
def plain(v):
    if isinstance(v, (set, frozenset)):
        try:
            return sorted(v)
        except TypeError:
            return list(v)
    raise TypeError(f"the result is a {type(v).__name__}, which has no JSON form")
result_out.write(json.dumps(fn(*args), default=plain) + "\n")
result_out.flush()
'''


@dataclass(frozen=True)
class CodeArgs:
    # last_block: the last closed ```python / ```py / ``` block, else no_code; whole: else the whole response
    extract: str = "last_block"
    tests_key: str = "tests"
    partial: bool = False  # score = fraction of cases passed (verl's `continuous`); default all-or-nothing
    run_all: Optional[bool] = None  # run every case even after a failure; default: = partial
    timeout_s: float = 5.0  # wall clock per case (the CPU limit is the same, rounded up)
    memory_mb: int = 512
    max_processes: int = 16
    max_output_bytes: int = 1 << 20
    file_size_mb: int = 16
    tmpfs_mb: int = 64
    max_cases: Optional[int] = None  # run only the first N cases (None: all)
    allow_unsandboxed: bool = False  # without a working sandbox, run plain subprocesses: UNSAFE, dev only

    def limits(self) -> Limits:
        return Limits(timeout_s=float(self.timeout_s), memory_mb=self.memory_mb, max_processes=self.max_processes,
                      max_output_bytes=self.max_output_bytes, file_size_mb=self.file_size_mb, tmpfs_mb=self.tmpfs_mb)


_TYPES = {"extract": (str,), "tests_key": (str,), "partial": (bool,), "run_all": (bool, type(None)),
          "timeout_s": (int, float), "memory_mb": (int,), "max_processes": (int,), "max_output_bytes": (int,),
          "file_size_mb": (int,), "tmpfs_mb": (int,), "max_cases": (int, type(None)), "allow_unsandboxed": (bool,)}


def _arg_errors(args: dict) -> list[str]:
    errors = []
    known = [f.name for f in fields(CodeArgs)]
    for k, v in args.items():
        if k not in _TYPES:
            errors.append(f"unknown argument {k!r}; the code reward takes: {', '.join(known)}")
        elif not isinstance(v, _TYPES[k]) or (isinstance(v, bool) and bool not in _TYPES[k]):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in _TYPES[k])
            errors.append(f"{k} = {v!r} must be {want}")
    if errors:
        return errors
    a = CodeArgs(**args)
    if a.extract not in EXTRACT_MODES:
        errors.append(f"extract = {a.extract!r} must be one of: {', '.join(EXTRACT_MODES)}")
    if not a.tests_key:
        errors.append("tests_key must name the row's test-case field (default 'tests')")
    if a.max_cases is not None and a.max_cases < 1:
        errors.append(f"max_cases = {a.max_cases} must be >= 1, or null for all cases")
    return errors + a.limits().check()


def check_args(args: dict) -> list[str]:
    """Errors in the code reward's arguments, and a missing sandbox (unless allow_unsandboxed is true); empty
    when it can run. Called from config validation, before anything starts."""
    errors = _arg_errors(dict(args))
    if errors or args.get("allow_unsandboxed"):
        return errors
    st = sandbox_status()
    if not st.ok:
        errors.append(f"the code reward runs generated code only in a bubblewrap sandbox, and none works here "
                      f"({st.detail}). To get one: {HOW_TO_GET_BWRAP}. To run it unsandboxed anyway (untrusted "
                      f"code on this machine, for development only) set allow_unsandboxed: true")
    return errors


def extract_program(response: str, mode: str = "last_block") -> Optional[str]:
    """The program in a response: its last closed ```python / ```py / ``` block; else, with mode "whole",
    the whole response. None when there is nothing to run."""
    blocks = [m.group(2) for m in _FENCE.finditer(response or "") if m.group(1).lower() in _PY_LANGS]
    code = blocks[-1] if blocks else (response if mode == "whole" else None)
    return code if code and code.strip() else None


def parse_tests(value: Any, key: str = "tests") -> tuple[list[tuple[Any, Any]], Optional[str]]:
    """(cases as (input, expected) pairs, fn_name or None) from either accepted form; ValueError names the
    row field and what is wrong."""
    where = f"row[{key!r}] (the code reward's tests_key)"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where} is a string but not JSON ({exc.msg} at {exc.pos})") from None
    if isinstance(value, dict):
        ins, outs, fn = value.get("inputs"), value.get("outputs"), value.get("fn_name") or None
        if not isinstance(ins, list) or not isinstance(outs, list) or len(ins) != len(outs):
            raise ValueError(f"{where} needs lists 'inputs' and 'outputs' of equal length")
        if fn is not None and not isinstance(fn, str):
            raise ValueError(f"{where}['fn_name'] must be a function name, got {type(fn).__name__}")
        cases = list(zip(ins, outs))
    elif isinstance(value, list) and all(isinstance(c, dict) and "input" in c and "output" in c for c in value):
        if any(c.get("testtype") == "functional" for c in value):
            raise ValueError(f"{where} has functional cases; give them as {{'inputs', 'outputs', 'fn_name'}}")
        cases, fn = [(c["input"], c["output"]) for c in value], None
    else:
        raise ValueError(f"{where} must be {{'inputs': [...], 'outputs': [...], 'fn_name'?}} or a list of "
                         f"{{'input': str, 'output': str}}, got {type(value).__name__}")
    if not cases:
        raise ValueError(f"{where} has no test cases")
    return cases, fn


def _text(v: Any) -> str:
    return "\n".join(map(str, v)) if isinstance(v, list) else str(v)


def _lines(text: str) -> list[str]:
    lines = [" ".join(line.split()) for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def _call_args(v: Any) -> list:
    if isinstance(v, str):  # LiveCodeBench: one JSON value per line
        return [json.loads(line) for line in v.splitlines() if line.strip()]
    return v if isinstance(v, list) else [v]


def _expected_value(v: Any) -> Any:
    if isinstance(v, str):
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return v
    return v


def same_value(a: Any, b: Any) -> bool:
    """JSON-value equality with float tolerance; a bool equals only a bool."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _judge(res: RunResult, expected: Any, fn_name: Optional[str]) -> str:
    """The case's reason: ok, wrong_answer, or how the run failed."""
    if res.reason != "ok":
        return res.reason
    out = res.stdout.decode("utf-8", "replace")
    if fn_name is None:
        return "ok" if _lines(out) == _lines(_text(expected)) else "wrong_answer"
    try:
        got = json.loads(out.strip().splitlines()[-1]) if out.strip() else None
    except (json.JSONDecodeError, IndexError):
        return "wrong_answer"
    want = _expected_value(expected)
    if same_value(got, want) or (isinstance(want, list) and len(want) == 1 and same_value(got, want[0])):
        return "ok"
    return "wrong_answer"


_warned = threading.Event()


def _warn_unsandboxed(detail: str) -> None:
    if not _warned.is_set():
        _warned.set()
        print(f"WARNING: m2po code reward: no working sandbox ({detail}) and allow_unsandboxed is true: UNTRUSTED "
              f"MODEL OUTPUT RUNS UNSANDBOXED on this machine, with rlimits only (it can read and write your files "
              f"and reach the network). Use this for development only.", file=sys.stderr, flush=True)


def _runner(a: CodeArgs):
    st = sandbox_status()
    if st.ok:
        return run_sandboxed
    if not a.allow_unsandboxed:
        raise RuntimeError(f"code reward: refusing to run generated code without a sandbox ({st.detail}); "
                           f"{HOW_TO_GET_BWRAP}; or set allow_unsandboxed: true (unsafe)")
    _warn_unsandboxed(st.detail)
    return run_unsandboxed


def code_reward(response: str, token_ids: list[int], row: dict, **args) -> dict:
    """Score a response's program against the row's test cases (see the module doc)."""
    errors = _arg_errors(args)
    if errors:
        raise ValueError("code reward arguments: " + "; ".join(errors))
    a = CodeArgs(**args)
    run_all = a.partial if a.run_all is None else a.run_all
    if a.tests_key not in row:
        raise ValueError(f"the row has no {a.tests_key!r} field (the code reward's tests_key); its fields: "
                         f"{', '.join(sorted(map(str, row))[:12])}")
    cases, fn_name = parse_tests(row[a.tests_key], a.tests_key)
    if a.max_cases is not None:
        cases = cases[:a.max_cases]
    out = {"score": 0.0, "passed": 0.0, **{r: 0.0 for r in FAILURE_REASONS if r != "sandbox_error"}}
    code = extract_program(response, a.extract)
    if code is None:
        out["no_code"] = 1.0
        return out
    run, limits = _runner(a), a.limits()
    files = {"main.py": code.encode()}
    if fn_name:
        files["harness.py"] = _HARNESS.encode()
    passed = 0
    for inp, expected in cases:
        if fn_name:
            try:
                stdin = json.dumps(_call_args(inp)).encode()
            except (json.JSONDecodeError, TypeError) as exc:
                raise ValueError(f"row[{a.tests_key!r}]: a case's input is not JSON arguments ({exc})") from None
            res = run(files, "harness.py", stdin, limits, args=(fn_name,))
        else:
            res = run(files, "main.py", _text(inp).encode(), limits)
        reason = _judge(res, expected, fn_name)
        if reason == "sandbox_error":  # the machine's failure, not the policy's: the recipe's on_error decides
            raise RuntimeError(f"code reward: the sandbox failed to start: {res.detail}")
        if reason == "ok":
            passed += 1
            continue
        out[reason] = 1.0
        if not run_all:
            break
    out["passed"] = passed / len(cases)
    out["score"] = out["passed"] if a.partial else float(passed == len(cases))
    return out
