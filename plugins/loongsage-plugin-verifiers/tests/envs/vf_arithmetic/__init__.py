"""``vf_arithmetic``: one-digit additions and subtractions, answered in one turn.

The quickstart's task in verifiers' form: the prompt is ``What is 3 + 5?`` (the format the
quickstart model was warm-started on), the ``correct`` reward is 1 when the last integer of the
reply is the answer, the ``answered`` metric 1 when the reply holds an integer at all. The 200
expressions ``a op b`` (``a, b`` in 0..9, ``op`` in ``+ -``) are split for good: every fifth one
(40) is the ``eval`` split, the other 160 the ``train`` split, shuffled by ``seed``.

The package exports verifiers' built-in ``NullHarness``, which makes it this taskset's default
harness: a plain chat loop, no tools, one model turn for a reply without tool calls.
"""

from __future__ import annotations

import random
import re
from typing import Literal

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness

NUMBER = re.compile(r"-?\d+")


class ArithmeticData(vf.TaskData):
    answer: str
    """The result, as a decimal string."""


class ArithmeticConfig(vf.TasksetConfig):
    split: Literal["train", "eval"] = "train"
    """Which tasks: the 160 training expressions or the 40 held-out ones."""
    seed: int = 0
    """Shuffles the split's order."""


def last_integer(text: str) -> int | None:
    """The last integer written in ``text``, if any."""
    found = NUMBER.findall(text)
    return int(found[-1]) if found else None


class ArithmeticTask(vf.Task[ArithmeticData]):
    @vf.reward
    async def correct(self, task: ArithmeticData, trace: vf.Trace) -> float:
        return float(last_integer(trace.last_reply) == int(task.answer))

    @vf.metric
    async def answered(self, trace: vf.Trace) -> float:
        return float(last_integer(trace.last_reply) is not None)


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, ArithmeticConfig]):
    def load(self) -> list[ArithmeticTask]:
        expressions = [(a, op, b) for a in range(10) for op in "+-" for b in range(10)]
        held_out = self.config.split == "eval"
        chosen = [e for i, e in enumerate(expressions) if (i % 5 == 0) == held_out]
        random.Random(self.config.seed).shuffle(chosen)
        return [ArithmeticTask(ArithmeticData(prompt=f"What is {a} {op} {b}?",
                                              answer=str(a + b if op == "+" else a - b)), self.config.task)
                for a, op, b in chosen]


__all__ = ["ArithmeticTaskset", "NullHarness"]
