"""Countdown's rule-based reward: reach row["target"] from row["numbers"] with + - * (no division, no
negative literals), each given number used at most once (Countdown's own rule; not all need be used).

The answer is the last \\boxed{...}: an expression over the numbers ("\\boxed{7*3-5}"), or a number that the
equation chain before it reaches ("3+5=8 8+7=15 \\boxed{15}": one operation per step, results written as
non-negative integers, a step's result may be used once later on).
Returns the score (1 when the answer reaches the target by the rules; `format_score` when it is a valid
answer by the rules that misses; else 0) and, each logged by the trainer as reward/<key>: acc (1 when
solved; in-run evaluation reports it as pass@1), valid_expr (the answer parses and every step's arithmetic
is right) and uses_numbers (it uses only the given numbers, each at most once).
"""
import ast
import re

_STEP = re.compile(r"(\d+)\s*([-+*])\s*(\d+)\s*=\s*(\d+)")
_OPS = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__, "+": int.__add__,
        "-": int.__sub__, "*": int.__mul__}


def _leaves_value(node):
    """(the integers an expression uses, its value); ValueError for anything but integers and binary + - *."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return [node.value], node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        (left, a), (right, b) = _leaves_value(node.left), _leaves_value(node.right)
        return left + right, _OPS[type(node.op)](a, b)
    raise ValueError("only integers and + - *")


def countdown_reward(response, token_ids, row, format_score=0.0, **args):
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", response)
    pool, valid, uses, value = list(row["numbers"]), False, False, None  # pool: what may still be used
    try:  # a too deep expression or a number of thousands of digits is malformed, not an error of the reward
        if boxed and boxed[-1].strip().isdigit():  # a number: the chain of steps before it must reach it
            steps = _STEP.findall(response[:response.rfind("\\boxed")])
            valid, uses, value = bool(steps), True, int(boxed[-1])  # a bare given number is no answer
            for a, op, b, c in steps:
                a, b, c = int(a), int(b), int(c)
                valid &= _OPS[op](a, b) == c
                for x in (a, b):
                    uses &= x in pool and not pool.remove(x)
                pool.append(c)
            uses &= value in pool  # a given number, or a step's result not used up
        elif boxed:
            leaves, value = _leaves_value(ast.parse(boxed[-1].replace("\\times", "*"), mode="eval").body)
            valid, uses = True, all(x in pool and not pool.remove(x) for x in leaves)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        valid = uses = False
    solved = valid and uses and value == int(row["target"])
    return {"score": 1.0 if solved else float(format_score) if valid and uses else 0.0, "acc": float(solved),
            "valid_expr": float(valid), "uses_numbers": float(uses)}
