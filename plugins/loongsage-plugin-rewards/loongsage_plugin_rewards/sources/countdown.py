"""The ``countdown`` data source: combine given numbers with + - * / to reach a target.

Each row is built backwards from a solution: numbers are drawn, a random expression over a subset
of them is evaluated, and its value becomes the target, so every question has at least one
solution (kept in the metadata). Scored by the ``countdown`` reward.
"""

from __future__ import annotations

import random
from fractions import Fraction
from typing import Any

from loongsage_hookspecs import BuildContext

DEFAULT_TEMPLATE = (
    "Using the numbers {numbers}, write an arithmetic expression that equals {target}. "
    "You may use + - * / and parentheses, and each number at most once. "
    "Put the final expression in \\boxed{}."
)


def _combine(rng: random.Random, items: list[tuple[Fraction, str]]) -> tuple[Fraction, str] | None:
    """Randomly fold ``items`` (value, text) into one expression, or None if a step was invalid."""
    items = items[:]
    while len(items) > 1:
        i, j = rng.sample(range(len(items)), 2)
        (va, ta), (vb, tb) = items[i], items[j]
        op = rng.choice("+-*/")
        if op == "+":
            value = va + vb
        elif op == "-":
            value = va - vb
        elif op == "*":
            value = va * vb
        else:
            if vb == 0 or (va / vb).denominator != 1:
                return None
            value = va / vb
        text = f"({ta} {op} {tb})"
        items = [x for k, x in enumerate(items) if k not in (i, j)] + [(value, text)]
    return items[0]


def countdown_rows(
    ctx: BuildContext | None = None,
    /,
    *,
    num_samples: int = 1000,
    seed: int = 0,
    num_numbers: int = 4,
    min_value: int = 1,
    max_value: int = 25,
    min_target: int = 1,
    max_target: int = 100,
    use_all: bool = False,
    template: str = DEFAULT_TEMPLATE,
) -> list[dict[str, Any]]:
    """Generate ``num_samples`` countdown puzzles.

    Args:
        ctx: the host's context (a data source factory's first argument, ``factory(ctx, **args)``);
            unused: the rows depend on the arguments only, so it may be left out in a direct call.
        num_samples: number of rows.
        seed: seed of the generator; rows are a pure function of all arguments.
        num_numbers: how many numbers each puzzle gives (2 to 8).
        min_value, max_value: range of the given numbers.
        min_target, max_target: range of the target (an integer).
        use_all: build the target from all numbers (otherwise from a random subset of 2 or more).
        template: prompt text with ``{numbers}`` (comma separated) and ``{target}``.

    Returns:
        Rows ``{"prompt": str, "label": target (int), "metadata": {"numbers", "target", "solution"}}``.
    """
    for name, value in (("num_samples", num_samples), ("num_numbers", num_numbers), ("min_value", min_value),
                        ("max_value", max_value), ("min_target", min_target), ("max_target", max_target)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"countdown: '{name}' must be an integer, got {value!r}")
    if not 2 <= num_numbers <= 8:
        raise ValueError(f"countdown: 'num_numbers' must be in [2, 8], got {num_numbers}")
    if not 0 <= min_value <= max_value or not min_target <= max_target or num_samples < 0:
        raise ValueError(f"countdown: empty range: values [{min_value}, {max_value}], "
                         f"targets [{min_target}, {max_target}], num_samples {num_samples}")
    if "{numbers}" not in template or "{target}" not in template:
        raise ValueError("countdown: 'template' must contain '{numbers}' and '{target}'")
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    attempts = 0
    while len(rows) < num_samples:
        attempts += 1
        if attempts > 1000 * (num_samples + 10):
            raise ValueError(f"countdown: cannot reach targets in [{min_target}, {max_target}] from numbers in "
                             f"[{min_value}, {max_value}]; widen the ranges")
        numbers = [rng.randint(min_value, max_value) for _ in range(num_numbers)]
        k = num_numbers if use_all else rng.randint(2, num_numbers)
        chosen = rng.sample(numbers, k)
        result = _combine(rng, [(Fraction(n), str(n)) for n in chosen])
        if result is None:
            continue
        value, text = result
        if value.denominator != 1 or not min_target <= value <= max_target:
            continue
        target = int(value)
        solution = text[1:-1] if text.startswith("(") and text.endswith(")") else text
        prompt = template.replace("{numbers}", ", ".join(map(str, numbers))).replace("{target}", str(target))
        rows.append({"prompt": prompt, "label": target,
                     "metadata": {"numbers": numbers, "target": target, "solution": solution}})
    return rows
