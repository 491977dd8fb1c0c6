"""``vf_guess``: a guessing game played over several turns.

The environment (``GuessEnv``, exported with the taskset, so verifiers plays every task with it)
holds a secret digit and talks with the policy turn by turn through an ``interaction``: the
policy guesses, the environment answers ``Higher.`` or ``Lower.`` (or asks for a digit), until the
policy guesses right or ``max_guesses`` guesses are spent. The ``won`` reward is 1 when the last
guess is the secret, the ``guesses`` metric counts the policy's turns. The default harness is
verifiers' ``NullHarness``, which resumes the conversation for each turn.
"""

from __future__ import annotations

import re

import verifiers.v1 as vf
from pydantic import Field
from verifiers.v1.harnesses.null import NullHarness

DIGIT = re.compile(r"-?\d+")


def guess_of(text: str) -> int | None:
    """The last integer of a reply: the guess."""
    found = DIGIT.findall(text)
    return int(found[-1]) if found else None


class GuessData(vf.TaskData):
    secret: int


class GuessTask(vf.Task[GuessData]):
    @vf.reward
    async def won(self, task: GuessData, trace: vf.Trace) -> float:
        return float(guess_of(trace.last_reply) == task.secret)

    @vf.metric
    async def guesses(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self) -> list[GuessTask]:
        prompt = "I am thinking of a number from 0 to 9. What is it?"
        return [GuessTask(GuessData(prompt=prompt, secret=s), self.config.task) for s in (3, 7, 1, 8, 5)]


class GuessEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    max_guesses: int = Field(3, ge=1)
    """Guesses the policy gets."""


class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        secret = task.data.secret
        async with agents.agent.interaction(task) as game:
            segment = await game.turn()
            for _ in range(self.config.max_guesses - 1):
                if segment.terminated:
                    return
                guess = guess_of(segment.last_reply)
                if guess == secret:
                    return
                hint = ("Answer with one number from 0 to 9." if guess is None
                        else "Higher." if guess < secret else "Lower.")
                segment = await game.turn(hint)


__all__ = ["GuessEnv", "GuessTaskset", "NullHarness"]
