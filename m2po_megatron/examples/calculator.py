"""A multi-turn, tool-using rollout function: the policy may call a calculator, the environment answers, the
policy answers. Recipes name it `rollout.function: calculator` (recipes/tiny-agent-cpu.yaml, `make demo-agent`).

One episode (the tokens of the tiny demo model, m2po_megatron/demo/tiny_agent.py):

    prompt       <s><|user|>Compute 37*48. Put the answer in \\boxed{}.<|assistant|>
    policy       <call name="calc">37*48</call>          turn 1 stops at the end-of-call token
    environment  <result>1776</result>                   appended by this function: never trained on
    policy       \\boxed{1776}</s>                        turn 2 stops at end of sequence

The turn stops at `</call>` through `stop_token_ids`: SGLang started without a tokenizer (as the runs start it)
refuses `stop` strings, so the end-of-call marker must be ONE token of the model's tokenizer. The reward is the
recipe's (None below): it scores the decoded text of the policy's tokens only, here
`<call name="calc">37*48</call>\\boxed{1776}`, so the answer must be the policy's own `\\boxed{}` (the
environment's result is not scored).

Model outputs are untrusted: the calculator parses the expression with `ast` and evaluates only numbers,
+ - * / // % ** (small exponents), unary signs and parentheses; nothing is ever passed to eval().

Written only with `m2po_megatron.api`, as a user's rollout function would be.
"""
from __future__ import annotations

import ast
import asyncio
import math
import operator
from typing import Union

from m2po_megatron import api
from m2po_megatron.api import RolloutContext, RolloutResult, ToolCall, Trajectory

TOOL = "calc"
CALL_END = "</call>"  # must be one token: the call turn stops at it (stop_token_ids)
MAX_TURNS = 3  # policy turns per episode by default (rollout.function_args: {max_turns: N})
MAX_EXPRESSION_CHARS = 200
MAX_ABS_VALUE = 10**15  # larger intermediate values are refused (as is a too large exponent)
MAX_EXPONENT = 64

TOOLS = [{"type": "function", "function": {
    "name": TOOL,
    "description": "Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses.",
    "parameters": {"type": "object", "required": ["expression"],
                   "properties": {"expression": {"type": "string", "description": "for example 37*48"}}}}}]

Number = Union[int, float]


class CalcError(ValueError):
    """The expression is not plain arithmetic, or its value is out of range."""


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression, or CalcError. Only numeric literals, the operators above and
    parentheses are accepted: names, calls, attributes, subscripts, strings, comparisons... are refused."""
    if not isinstance(expression, str):
        raise CalcError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:  # ValueError: e.g. a NUL byte
        raise CalcError(f"not an expression: {e.__class__.__name__}") from None
    return _value(tree.body, 0)


def _checked(x: Number) -> Number:
    if isinstance(x, float) and not math.isfinite(x) or abs(x) > MAX_ABS_VALUE:
        raise CalcError("value out of range")
    return x


def _value(node: ast.AST, depth: int) -> Number:
    if depth > 50:
        raise CalcError("expression nested too deeply")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, str, complex, None
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_value(node.operand, depth + 1)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left, depth + 1), _value(node.right, depth + 1)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or left == 0 and right < 0):
            raise CalcError("exponent out of range")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalcError("division by zero")
        try:
            value = _BINARY[type(node.op)](left, right)
        except (OverflowError, ArithmeticError):
            raise CalcError("value out of range") from None
        if isinstance(value, complex):
            raise CalcError("complex value")
        return _checked(value)
    raise CalcError(f"not arithmetic: {type(node).__name__}")


def format_value(x: Number) -> str:
    """37*48 -> "1776"; 7/2 -> "3.5"; 2/3 -> "0.666667" (6 significant digits)."""
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    return str(x) if isinstance(x, int) else f"{x:.6g}"


def environment_text(result: str) -> str:
    """What the environment appends after a call (its tokens are masked out of the loss)."""
    return f"<result>{result}</result>"


def run_call(call: ToolCall) -> tuple[str, bool]:
    """(the environment's text for one parsed call, whether the call succeeded)."""
    if call.error or call.name != TOOL:
        return environment_text("error"), False
    try:
        return environment_text(format_value(evaluate(call.arguments.get("expression")))), True
    except CalcError:
        return environment_text("error"), False


def call_end_id(tokenizer) -> int:
    ids = tokenizer.encode(CALL_END, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the calculator example stops a call turn at {CALL_END!r}, which must be one token of the "
                         f"tokenizer (it is {len(ids)}): add it as a token (SGLang without a tokenizer stops only at "
                         "stop_token_ids)")
    return ids[0]


async def run_locally(calls: list[ToolCall]) -> list[tuple[str, bool]]:
    """The tool calls of one turn, answered in this process (http_env.py answers them in another)."""
    return [run_call(c) for c in calls]


async def _episode(ctx: RolloutContext, i: int, parser: api.ToolParser, end_id: int, max_turns: int,
                   execute) -> RolloutResult:
    traj = Trajectory(ctx.prompt_ids)
    calls = ok = 0
    stops = [end_id] + ([ctx.tokenizer.eos_token_id] if ctx.tokenizer.eos_token_id is not None else [])
    for t in range(max_turns):
        sp = dict(ctx.sampling_params, stop_token_ids=stops)
        if ctx.max_context:  # keep prompt + response within what the servers take
            room = ctx.max_context - len(traj.context)
            if room < 1:
                break
            sp["max_new_tokens"] = min(int(sp.get("max_new_tokens") or room), room)
        gen = (await ctx.client.generate(traj.context, sp, seed=ctx.seed + i + t * ctx.n))[0]
        traj.add_generation(gen)
        if gen.finish_reason != "stop" or not gen.token_ids or gen.token_ids[-1] != end_id:
            break  # an answer (end of sequence), a truncated turn or an aborted one: the episode is over
        if t == max_turns - 1:
            break  # a call with no turn left to read its result
        _, found = parser.parse(ctx.tokenizer.decode(gen.token_ids, skip_special_tokens=False), TOOLS)
        replies = await execute(found) if found else [(environment_text("error"), False)]  # "</call>", no call
        calls += len(replies)
        ok += sum(good for _, good in replies)
        env = ctx.tokenizer.encode("".join(text for text, _ in replies), add_special_tokens=False)
        if ctx.max_context and len(traj.context) + len(env) >= ctx.max_context:
            break  # no room left for the result and an answer
        traj.add_environment(env)
    ctx.log(turns=traj.turns, tool_calls=calls, used_tool=float(calls > 0))
    if calls:  # averaged over the episodes that called the tool: the fraction of calls that returned a value
        ctx.log(tool_call_success=ok / calls)
    return traj.result(reward=None, metadata={"tool_calls": calls, "tool_calls_ok": ok})


async def rollout(ctx: RolloutContext) -> list[RolloutResult]:
    """ctx.n episodes of the prompt, concurrently; sample i's turn t is seeded ctx.seed + i + t * ctx.n."""
    return await rollout_with(ctx, run_locally)


async def rollout_with(ctx: RolloutContext, execute) -> list[RolloutResult]:
    """The episodes, with each turn's tool calls answered by `await execute(calls) -> [(text, ok), ...]`."""
    parser = ctx.tool_parser or api.tool_parser("m2po_tags")
    end_id = call_end_id(ctx.tokenizer)
    max_turns = int(ctx.args.get("max_turns", MAX_TURNS))
    return list(await asyncio.gather(*(_episode(ctx, i, parser, end_id, max_turns, execute)
                                       for i in range(ctx.n))))
