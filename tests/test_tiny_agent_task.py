"""The tool-use task of `make demo-agent` (m2po_megatron/demo/tiny_agent.py) and the example rollout function it
trains with (m2po_megatron/examples/calculator.py): the warm-up's traces are token for token what the rollout
function produces, the calculator evaluates arithmetic only, and against the real CPU rollout server the
function's results are exactly the engine's outputs and the environment's additions concatenated, with mask 1
on the engine's tokens only. The built model is warmed up 60 steps: enough to call the tool in about half of
its episodes (some calls malformed), which is what the server test needs; its success is not checked."""
import asyncio
import json

import pytest

from m2po_megatron import api
from m2po_megatron.api import Generation, RolloutContext, ToolCall
from m2po_megatron.demo.tiny_agent import (ADDED_TOKENS, CALL_CLOSE, INFO_FILE, ProductSpec, agent_splits,
                                           build_agent_tokenizer, trace_segments)
from m2po_megatron.demo.tiny_model import chat_prompt
from m2po_megatron.examples import calculator
from m2po_megatron.examples.calculator import CalcError, environment_text, evaluate, format_value, run_call
from tools.build_tiny_model import main as build_main


@pytest.fixture(scope="module")
def tok():
    return build_agent_tokenizer()


def _row(tok, split="train", i=0):
    r = agent_splits(0, ProductSpec(), 8, 8, 8, 8)[split][i]
    return dict(r, prompt=chat_prompt(tok, r["prompt"]), chat_template=True)


def test_the_call_tokens_are_single_non_special_tokens(tok):
    for t in ADDED_TOKENS:
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1
        # kept by decoding with or without skip_special_tokens: the parser and the reward see the call's text
        assert tok.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=False) == t
    assert calculator.call_end_id(tok) == tok.convert_tokens_to_ids(CALL_CLOSE)


def test_splits_are_disjoint_four_digit_products():
    s = agent_splits(3, ProductSpec(), 64, 64, 128, 10**6)
    keys = {k: {r["expression"] for r in rows} for k, rows in s.items()}
    assert [len(keys[k]) for k in ("eval", "calibration", "train")] == [64, 64, 128]
    assert sum(map(len, keys.values())) == len(set().union(*keys.values())) == ProductSpec().space
    for rows in s.values():
        for r in rows:
            a, b = map(int, r["expression"].split("*"))
            assert r["answer"] == str(a * b) and len(r["answer"]) == 4 and r["id"].startswith("synthetic/calculator/")
            assert r["prompt"] == f"Compute {a}*{b}. Put the answer in \\boxed{{}}."
    with pytest.raises(ValueError):
        agent_splits(0, ProductSpec(), 4000, 600, 100, 10)


def test_trace_format_and_masks(tok):
    r = _row(tok)
    a, b = map(int, r["expression"].split("*"))
    segs = trace_segments(tok, r, call=True)
    texts = [tok.decode(ids, skip_special_tokens=False) for ids, _ in segs]
    assert texts == [r["prompt"], f'<call name="calc">{a}*{b}</call>', f"<result>{a * b}</result>",
                     f"\\boxed{{{a * b}}}</s>"]
    assert [m for _, m in segs] == [0, 1, 0, 1]
    assert segs[1][0][-1] == calculator.call_end_id(tok)  # the call turn ends at the stop token
    # the environment's tokens are exactly what the rollout function appends
    assert segs[2][0] == tok.encode(run_call(ToolCall("calc", {"expression": r["expression"]}))[0],
                                    add_special_tokens=False)
    direct = trace_segments(tok, r, call=False)
    assert [m for _, m in direct] == [0, 1] and direct[1][0] == segs[3][0]


class _Scripted:
    """A TokenClient answering each turn with given token ids."""

    def __init__(self, turns):
        self.turns, self.inputs = list(turns), []

    async def generate(self, input_ids, sampling_params=None, *, n=1, seed=None):
        self.inputs.append((list(input_ids), dict(sampling_params or {}), seed))
        ids = self.turns.pop(0)
        return [Generation(ids, [-0.5] * len(ids), [3] * len(ids), "stop")]


def _ctx(tok, row, client, n=1, seed=0, logs=None, **kw):
    async def reward(text):
        return 0.0

    return RolloutContext(row=row, prompt_ids=tok.encode(row["prompt"], add_special_tokens=False), tokenizer=tok,
                          sampling_params={"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 24}, n=n, seed=seed,
                          client=client, reward=reward,
                          log=(lambda **k: logs.append(k)) if logs is not None else (lambda **k: None),
                          max_context=128, **kw)


def test_the_rollout_of_a_trace_is_the_trace(tok):
    """Played by a client that generates the warm-up trace's policy segments, the rollout function returns the
    trace: the warm-up trains on exactly the token format the rollout produces."""
    r = _row(tok)
    segs = trace_segments(tok, r, call=True)
    client, logs = _Scripted([segs[1][0], segs[3][0]]), []
    (res,) = asyncio.run(calculator.rollout(_ctx(tok, r, client, seed=7, logs=logs)))
    assert res.token_ids == [t for ids, _ in segs[1:] for t in ids]
    assert res.loss_mask == [m for ids, m in segs[1:] for _ in ids]
    assert [s for _, _, s in client.inputs] == [7, 8]  # seed + i + t * n
    assert client.inputs[1][0] == segs[0][0] + segs[1][0] + segs[2][0]
    assert all(sp["stop_token_ids"] == [calculator.call_end_id(tok), tok.eos_token_id] for _, sp, _ in client.inputs)
    assert res.reward is None and res.metadata["turns"] == 2 and res.metadata["tool_calls_ok"] == 1
    assert {"turns": 2, "tool_calls": 1, "used_tool": 1.0} in logs and {"tool_call_success": 1.0} in logs
    # the recipe's reward scores the policy's tokens: the answer is there, not only in the environment's
    from m2po_megatron.reward import math_verify_reward

    policy = [t for t, m in zip(res.token_ids, res.loss_mask) if m]
    assert math_verify_reward(tok.decode(policy, skip_special_tokens=True), r["answer"]) == 1.0


def test_a_malformed_call_gets_an_error_and_the_turns_are_bounded(tok):
    r = _row(tok)
    end = calculator.call_end_id(tok)
    bad = tok.encode('<call name="calc">37*__import__("os")', add_special_tokens=False) + [end]
    client = _Scripted([bad, bad, bad, bad])
    (res,) = asyncio.run(calculator.rollout(_ctx(tok, r, client, args={"max_turns": 3})))
    err = tok.encode(environment_text("error"), add_special_tokens=False)
    assert res.token_ids == bad + err + bad + err + bad  # no result after the last turn's call
    assert res.metadata == {"turns": 3, "tool_calls": 2, "tool_calls_ok": 0}
    assert len(client.turns) == 1


@pytest.mark.parametrize("expr,value", [("37*48", 1776), ("7/2", 3.5), ("(1+2)**3", 27), ("-5 + 3", -2),
                                        ("10//3", 3), ("10 % 4", 2), ("0.5*4", 2.0), (" 12*12 ", 144)])
def test_the_calculator_evaluates_arithmetic(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os').system('true')", "a+1", "open('x')", "[1, 2]", "'a'*3",
                                  "2**1000", "1/0", "5 % 0", "1e308*10", "True+1", "lambda: 1", "1 if 1 else 2",
                                  "x.y", "(1).real", "1 < 2", "1j*2", "", "1+", "9" * 300, "{1: 2}", "f'{1}'",
                                  "0**-1", "-" * 60 + "1"])
def test_the_calculator_refuses_anything_else(expr):
    with pytest.raises(CalcError):
        evaluate(expr)


def test_run_call_answers_every_call():
    assert run_call(ToolCall("calc", {"expression": "6*7"})) == ("<result>42</result>", True)
    assert run_call(ToolCall("calc", {"expression": "os.system"})) == ("<result>error</result>", False)
    assert run_call(ToolCall("calc", {}, error="no closing </call> tag")) == ("<result>error</result>", False)
    assert run_call(ToolCall("search", {"expression": "1"})) == ("<result>error</result>", False)
    assert run_call(ToolCall("calc", {"expression": 12})) == ("<result>error</result>", False)
    assert format_value(2 / 3) == "0.666667" and format_value(4.0) == "4"


def test_the_recipe_is_valid():
    from m2po_megatron.config import load_config
    from m2po_megatron.config.paths import PROJECT_ROOT

    cfg = load_config("tiny-agent-cpu", [], check_files=False)
    assert cfg.rollout.function == "calculator" and cfg.rollout.tool_call_parser == "m2po_tags"
    assert cfg.staleness.mode == "bounded" and cfg.model.hf_path == str(PROJECT_ROOT / ".cache/tiny-agent-task")
    assert api.registered_rollouts()["calculator"] == "m2po_megatron.examples.calculator:rollout"


def test_the_builder_refuses_flags_of_the_sums_task(tmp_path):
    with pytest.raises(SystemExit) as e:
        build_main([str(tmp_path / "x"), "--agent", "--moe"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        build_main([str(tmp_path / "x"), "--p-call", "0.5"])
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------------------------
# Against the real CPU rollout server


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("agent") / "task"
    assert build_main([str(d), "--agent", "--seed", "0", "--n-eval", "16", "--n-calibration", "16", "--n-train",
                       "16", "--max-warmup-steps", "60", "--check-every", "60", "--target-accuracy", "0.99"]) == 0
    return d


def test_the_build_writes_the_task(built):
    from transformers import AutoTokenizer

    info = json.loads((built / INFO_FILE).read_text())
    assert info["task"] == "calculator" and info["warmup_steps"] == 60 and info["added_tokens"] == list(ADDED_TOKENS)
    rows = [json.loads(line) for line in (built / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and all(r["chat_template"] and r["prompt"].endswith("<|assistant|>") for r in rows)
    again = AutoTokenizer.from_pretrained(built)
    assert trace_segments(again, rows[0], True) == trace_segments(build_agent_tokenizer(), rows[0], True)


class _Recording:
    """The run's GroupClient, recording every call's input, seed and what the engine returned."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    async def generate(self, input_ids, sampling_params=None, *, n=1, seed=None):
        out = await self.inner.generate(input_ids, sampling_params, n=n, seed=seed)
        self.calls.append((list(input_ids), seed, out))
        return out


@pytest.mark.timeout(300)
def test_rollout_against_the_cpu_server(built, tmp_path):
    from transformers import AutoTokenizer

    from m2po_megatron.agents.client import GroupClient
    from m2po_megatron.rollout.client import RolloutClient
    from tests.rollout.conftest import local_server

    tok = AutoTokenizer.from_pretrained(built)
    rows = [json.loads(line) for line in (built / "eval.jsonl").read_text().splitlines()][:6]
    parser = api.tool_parser("m2po_tags")
    end, n = calculator.call_end_id(tok), 8

    async def go(url):
        async with RolloutClient([url], request_timeout_s=120) as rc:
            recs = [_Recording(GroupClient(rc)) for _ in rows]
            ctxs = [_ctx(tok, r, rec, n=n, seed=1000 * g, tool_parser=parser) for g, (r, rec) in
                    enumerate(zip(rows, recs))]
            return recs, ctxs, await asyncio.wait_for(asyncio.gather(*(calculator.rollout(c) for c in ctxs)), 240)

    with local_server(built, tmp_path, random_seed=0, enable_deterministic_inference=True,
                      context_length=128) as server:
        recs, ctxs, results = asyncio.run(go(server.url))

    turns_seen = set()
    for rec, ctx, res in zip(recs, ctxs, results):
        assert len(res) == n
        by_seed = {seed: (inp, out[0]) for inp, seed, out in rec.calls}
        assert len(by_seed) == len(rec.calls)  # one call per (sample, turn) seed
        for i, r in enumerate(res):
            ids, mask, context = [], [], list(ctx.prompt_ids)
            for t in range(calculator.MAX_TURNS):
                if ctx.seed + i + t * n not in by_seed:
                    break
                inp, gen = by_seed[ctx.seed + i + t * n]
                assert inp == context  # each turn continues exactly the episode so far
                ids += gen.token_ids
                mask += [1] * len(gen.token_ids)
                assert r.logprobs[len(ids) - len(gen.token_ids):len(ids)] == gen.logprobs
                if gen.token_ids[-1] != end or t == calculator.MAX_TURNS - 1:
                    break
                # the CPU server, as SGLang, keeps the matched stop token in output_ids
                assert gen.finish_reason == "stop"
                _, calls = parser.parse(tok.decode(gen.token_ids, skip_special_tokens=False), calculator.TOOLS)
                env = tok.encode("".join(run_call(c)[0] for c in calls) or environment_text("error"),
                                 add_special_tokens=False)
                ids += env
                mask += [0] * len(env)
                context = list(ctx.prompt_ids) + ids
            assert r.token_ids == ids and r.loss_mask == mask
            assert r.metadata["turns"] == sum(ctx.seed + i + t * n in by_seed for t in range(calculator.MAX_TURNS))
            assert all(v >= 0 for v, m in zip(r.versions, r.loss_mask) if m)
            assert len(ctx.prompt_ids) + len(r.token_ids) <= 128
            turns_seen.add(r.metadata["turns"])
    assert {1, 2} <= turns_seen  # both direct answers and tool calls were exercised


# The same environment behind HTTP, in a process of its own (m2po_megatron/examples/http_env.py)


@pytest.mark.timeout(300)
def test_the_http_environment_gives_the_in_process_episodes(built, tmp_path):
    """calculator_http's episodes equal calculator's, token for token (the same seeds on a deterministic
    server), its environment answering from its own process."""
    from transformers import AutoTokenizer

    from m2po_megatron.agents.client import GroupClient
    from m2po_megatron.examples import http_env
    from m2po_megatron.rollout.client import RolloutClient
    from tests.rollout.conftest import local_server

    tok = AutoTokenizer.from_pretrained(built)
    rows = [json.loads(line) for line in (built / "eval.jsonl").read_text().splitlines()][:4]
    parser = api.tool_parser("m2po_tags")

    async def go(url, fn):
        async with RolloutClient([url], request_timeout_s=120) as rc:
            ctxs = [_ctx(tok, r, GroupClient(rc), n=4, seed=100 * g, tool_parser=parser) for g, r in enumerate(rows)]
            return await asyncio.wait_for(asyncio.gather(*(fn(c) for c in ctxs)), 240)

    try:
        with local_server(built, tmp_path, random_seed=0, enable_deterministic_inference=True,
                          context_length=128) as server:
            local = asyncio.run(go(server.url, calculator.rollout))
            remote = asyncio.run(go(server.url, http_env.rollout))
        server_proc = http_env.EnvServer.shared().proc
        assert server_proc.poll() is None  # started once, by the first group, and still serving
    finally:
        http_env.EnvServer.stop_shared()
    assert server_proc.poll() is not None
    calls = 0
    for a, b in zip(local, remote):
        for x, y in zip(a, b):
            assert (x.token_ids, x.loss_mask, x.metadata) == (y.token_ids, y.loss_mask, y.metadata)
            calls += x.metadata["tool_calls"]
    assert calls > 0  # the boundary was crossed


@pytest.mark.timeout(120)
def test_the_http_environment_refuses_strangers_and_leaves_with_its_parent(tmp_path):
    """Without the API key: 401. Its parent killed with SIGKILL: the environment server exits too."""
    import os
    import signal
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    parent = subprocess.Popen([sys.executable, "-c", (
        "from m2po_megatron.examples.http_env import EnvServer; import time; s = EnvServer(); "
        "print(s.url, s.proc.pid, flush=True); time.sleep(300)")], stdout=subprocess.PIPE, text=True)
    try:
        url, pid = parent.stdout.readline().split()
        req = urllib.request.Request(f"{url}/step", data=b'{"calls": []}', method="POST",
                                     headers={"Authorization": "Bearer wrong", "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 401
        assert url.startswith("http://127.0.0.1:")
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.kill(int(pid), signal.SIGKILL)
        pytest.fail("the environment server outlived its parent")
