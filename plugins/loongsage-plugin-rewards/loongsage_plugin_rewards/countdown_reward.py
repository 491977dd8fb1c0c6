"""The ``countdown`` reward: is the response an expression over the given numbers that hits the target?

The expression is the extracted final answer (see :mod:`.extract`); when it contains ``=``, the
part before the first ``=`` is used (``3 * 7 + 20 = 41`` counts). It is parsed with
:mod:`ast` and only integer literals, ``+ - * /`` and parentheses are accepted; it is evaluated
with exact fractions. The numbers used must be a sub-multiset of ``metadata["numbers"]`` (all of
them when ``use_all``).
"""

from __future__ import annotations

import ast
from collections import Counter
from fractions import Fraction
from typing import Any

from loongsage_hookspecs import Reward, Trajectory

from .extract import extract_final_answer

MAX_EXPRESSION_CHARS = 256
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}


class _Invalid(ValueError):
    """The expression uses something other than integers, + - * / and parentheses."""


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise _Invalid("division by zero")
        return _OPS[type(node.op)](left, right)
    raise _Invalid(f"unsupported syntax {type(node).__name__}")


def parse_expression(text: str) -> tuple[Fraction, list[int]] | None:
    """(value, integers used) of a ``+ - * /`` expression, or None when it is not one."""
    expr = text.split("=", 1)[0].strip().replace("×", "*").replace("÷", "/").replace("\\times", "*")
    expr = expr.replace("\\cdot", "*").replace("\\div", "/").strip("$ ")
    if not expr or len(expr) > MAX_EXPRESSION_CHARS:
        return None
    try:
        tree = ast.parse(expr, mode="eval")
        used: list[int] = []
        return _evaluate(tree, used), used
    except (SyntaxError, _Invalid, ValueError):
        return None


def _numbers(trajectory: Trajectory) -> list[int]:
    numbers = trajectory.metadata.get("numbers")
    if not isinstance(numbers, (list, tuple)) or not all(isinstance(n, int) for n in numbers):
        raise ValueError(f"countdown: trajectory metadata needs 'numbers' (a list of ints), got {numbers!r}")
    return list(numbers)


def _target(trajectory: Trajectory) -> Fraction:
    target: Any = trajectory.metadata.get("target", trajectory.label)
    if isinstance(target, dict):
        target = target.get("target")
    try:
        return Fraction(str(target).strip())
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"countdown: the target (metadata 'target' or label) is not a number: {target!r}") from None


def countdown_reward(trajectory: Trajectory, *, use_all: bool = False, format_score: float = 0.0,
                     score: float = 1.0) -> Reward:
    """``score`` for a valid expression equal to the target; ``format_score`` for a valid wrong one.

    Args:
        use_all: the expression must use every given number exactly once.
        format_score: reward for an expression that parses and uses allowed numbers but misses.
        score: the reward for a correct expression.

    Details: ``correct``, ``parsed`` (an arithmetic expression was found), ``valid_numbers``.
    """
    numbers, target = _numbers(trajectory), _target(trajectory)
    parsed = parse_expression(extract_final_answer(trajectory.response_text or ""))
    if parsed is None:
        return Reward(score=0.0, details={"correct": 0.0, "parsed": 0.0, "valid_numbers": 0.0})
    value, used = parsed
    available, wanted = Counter(numbers), Counter(used)
    valid = wanted == available if use_all else not (wanted - available)
    correct = valid and value == target
    reward = float(score) if correct else (float(format_score) if valid else 0.0)
    return Reward(score=reward, details={"correct": float(correct), "parsed": 1.0, "valid_numbers": float(valid)})
