"""A scripted agent harness that compacts its history and runs a sub-agent, as coding agents do.

The main agent makes three turns, then compacts its history (the three turns are replaced with a
summary message after its system prompt and task) and makes a fourth; then it runs a sub-agent (a
conversation of its own with another system prompt, two turns), puts the sub-agent's answer into
its own conversation and makes a last turn. Every request goes over HTTP with the ``openai`` SDK,
asking for log-probs, and every answer is kept (``calls``) for the tests to hold the record against.

The router records such a trajectory as a tree of three segments: the main agent's first three
turns (segment 0), the compacted conversation (segment 1, forked from segment 0 after the task)
with turns 4 and 7, and the sub-agent's (segment 2, forked from segment 0 inside the system
prompt) with turns 5 and 6.

Loaded by path by the tests, and by a job as a ``[plugins] modules`` entry: it registers the agent
``compacting_harness`` and the reward ``first_sample`` (a score that differs between samples).
"""

from __future__ import annotations

from typing import Any

from loongsage_hookspecs import AgentResult, AgentSpec, Reward, RewardSpec, hookimpl

MAIN_SYSTEM = "You are the main agent. Work on the task step by step."
SUB_SYSTEM = "You are a research sub-agent. Answer the one question you are given."
SUMMARY = "Summary of the work so far: three steps were made; continue from here."
SUB_QUESTION = "Which file holds the configuration?"


class CompactingHarness:
    """The scripted harness; ``calls`` holds ``(conversation name, request messages, answer)`` of
    every turn, in order."""

    def __init__(self, max_tokens: int = 8) -> None:
        self.max_tokens = max_tokens
        self.calls: list[tuple[str, list[dict[str, Any]], Any]] = []

    async def run(self, ctx: Any) -> AgentResult:
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)

        async def chat(name: str, messages: list[dict[str, Any]]) -> str:
            answer = await client.chat.completions.create(model="policy", messages=messages,
                                                          max_tokens=self.max_tokens, logprobs=True)
            self.calls.append((name, [dict(m) for m in messages], answer))
            return answer.choices[0].message.content or ""

        try:
            prompt = ctx.prompt if isinstance(ctx.prompt, str) else ctx.prompt[-1]["content"]  # text or messages
            task = [{"role": "system", "content": MAIN_SYSTEM}, {"role": "user", "content": prompt}]
            main = list(task)
            for step in range(3):
                text = await chat("main", main)
                main += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Observation {step}."}]
            main = task + [{"role": "user", "content": SUMMARY}]  # compaction
            main.append({"role": "assistant", "content": await chat("main", main)})
            sub = [{"role": "system", "content": SUB_SYSTEM}, {"role": "user", "content": SUB_QUESTION}]
            sub.append({"role": "assistant", "content": await chat("sub", sub)})
            sub.append({"role": "user", "content": "Be more specific."})
            found = await chat("sub", sub)
            main.append({"role": "user", "content": f"The sub-agent found: {found}"})
            final = await chat("main", main)
        finally:
            await client.close()
        return AgentResult(response_text=final, messages=main + [{"role": "assistant", "content": final}],
                           metadata={"sub_agent_turns": 2, "compactions": 1})


def first_sample(trajectory: Any) -> Reward:
    """1 for the first sample of a group, else 0 (a run names its trajectories
    ``{step}-{prompt}-{sample}``), so the samples of a group differ."""
    first = trajectory.id.rsplit("-", 1)[-1] == "0"
    return Reward(score=1.0 if first else 0.0, reason="the first sample" if first else "a later sample")


def make_harness(ctx: Any, max_tokens: int = 8) -> CompactingHarness:
    """The agent factory (``agent_args``: ``max_tokens`` per turn)."""
    return CompactingHarness(max_tokens=max_tokens)


@hookimpl
def loongsage_agents():
    yield AgentSpec(name="compacting_harness", factory=make_harness,
                    description="compacts its history after three turns and runs a two-turn sub-agent")


@hookimpl
def loongsage_rewards():
    yield RewardSpec(name="first_sample", fn=first_sample, description="1 for the first sample of a group, else 0")
