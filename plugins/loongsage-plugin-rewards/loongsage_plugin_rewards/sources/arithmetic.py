"""The ``arithmetic`` data source: short integer expressions such as ``What is 7 - 3?``.

Rows are drawn with a private :class:`random.Random` seeded by ``seed``, so the same arguments
always give the same rows (a resumed run sees the same prompts). The label is the integer result
as a decimal string, so ``exact_match`` and ``numeric_match`` both score it.
"""

from __future__ import annotations

import random
from typing import Any

from loongsage_hookspecs import BuildContext

OPERATORS = ("+", "-", "*")
DEFAULT_TEMPLATE = "What is {expression}?"


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"arithmetic: '{name}' must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"arithmetic: '{name}' must be {bound}, got {value}")
    return value


def evaluate(operands: list[int], operators: list[str]) -> int:
    """Value of ``operands[0] op0 operands[1] op1 ...`` with ``*`` binding tighter than ``+``/``-``."""
    if len(operators) != len(operands) - 1:
        raise ValueError("evaluate: need exactly one operator between each pair of operands")
    terms: list[int] = [operands[0]]
    signs: list[int] = [1]
    for op, value in zip(operators, operands[1:]):
        if op == "*":
            terms[-1] *= value
        elif op in "+-":
            terms.append(value)
            signs.append(1 if op == "+" else -1)
        else:
            raise ValueError(f"evaluate: unknown operator {op!r}")
    return sum(s * t for s, t in zip(signs, terms))


def arithmetic_rows(
    ctx: BuildContext | None = None,
    /,
    *,
    num_samples: int = 1000,
    seed: int = 0,
    digits: int = 1,
    num_operands: int = 2,
    ops: str = "+-",
    allow_negative: bool = True,
    template: str = DEFAULT_TEMPLATE,
) -> list[dict[str, Any]]:
    """Generate ``num_samples`` arithmetic questions.

    Args:
        ctx: the host's context (a data source factory's first argument, ``factory(ctx, **args)``);
            unused: the rows depend on the arguments only, so it may be left out in a direct call.
        num_samples: number of rows.
        seed: seed of the generator; rows are a pure function of all arguments.
        digits: each operand is drawn uniformly from ``0 .. 10**digits - 1``.
        num_operands: operands per expression (2 or more).
        ops: the operators to draw from, a string over ``"+-*"`` (``*`` binds tighter).
        allow_negative: when false, expressions whose value is negative are redrawn.
        template: the prompt text; ``{expression}`` is replaced by e.g. ``"3 + 5"``.

    Returns:
        Rows ``{"prompt": str, "label": str, "metadata": {"expression", "operands", "operators",
        "answer"}}`` where ``label`` is the decimal result (``"-4"``) and ``answer`` the same int.
    """
    _check_int("num_samples", num_samples, 0)
    _check_int("seed", seed, -(2**63))
    _check_int("digits", digits, 1, 9)
    _check_int("num_operands", num_operands, 2, 16)
    if not isinstance(ops, str) or not ops or any(op not in OPERATORS for op in ops):
        raise ValueError(f"arithmetic: 'ops' must be a non-empty string over {''.join(OPERATORS)!r}, got {ops!r}")
    if "{expression}" not in template:
        raise ValueError(f"arithmetic: 'template' must contain '{{expression}}', got {template!r}")
    rng = random.Random(seed)
    high = 10**digits - 1
    rows: list[dict[str, Any]] = []
    rejected = 0
    while len(rows) < num_samples:
        operands = [rng.randint(0, high) for _ in range(num_operands)]
        operators = [rng.choice(ops) for _ in range(num_operands - 1)]
        value = evaluate(operands, operators)
        if value < 0 and not allow_negative:
            rejected += 1
            if rejected > 100 * (num_samples + 10):
                raise ValueError(f"arithmetic: allow_negative=false but almost every expression over ops={ops!r} "
                                 f"with {num_operands} operands is negative; allow negatives or use '+'")
            continue
        expression = " ".join(
            [str(operands[0])] + [f"{op} {x}" for op, x in zip(operators, operands[1:])]
        )
        rows.append({
            "prompt": template.replace("{expression}", expression),
            "label": str(value),
            "metadata": {"expression": expression, "operands": operands, "operators": operators, "answer": value},
        })
    return rows
