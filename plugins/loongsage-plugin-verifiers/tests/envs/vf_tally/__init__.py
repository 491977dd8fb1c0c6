"""``vf_tally``: bring a tally to a target with a tool, scored on what the tool did.

A stateful tool environment: the taskset's MCP tool server (``vf_tally.tools``, started by
verifiers in a local subprocess and shared by the episodes playing at the same time) has one
tool, ``add``, which adds to the calling rollout's tally, kept in its state (``TallyState``,
synced back to the rollout's trace over verifiers' state channel). The ``reached`` reward is 1
when the tally ends at the task's target, the ``tool_calls`` metric counts the tool results. The
default harness is verifiers' ``NullHarness``: a chat loop that offers the MCP tools to the model,
runs its calls and sends the results back, until a reply without calls or the seat's
``max_turns``.
"""

from __future__ import annotations

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness

from .tools import TallyState, TallyToolset


class TallyData(vf.TaskData):
    target: int


class TallyConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()
    """Where the shared tool server runs (a local subprocess by default)."""


class TallyTask(vf.Task[TallyData, TallyState]):
    @vf.reward
    async def reached(self, task: TallyData, trace: vf.Trace) -> float:
        return float(trace.state.total == task.target)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class TallyTaskset(vf.Taskset[TallyTask, TallyConfig]):
    @classmethod
    def toolsets(cls, config: TallyConfig) -> list[vf.Toolset]:
        return [TallyToolset(config.tools)]

    def load(self) -> list[TallyTask]:
        return [TallyTask(TallyData(prompt=f"Call add until the tally is {target}, then say Done.", target=target),
                          self.config.task) for target in (2, 1, 3)]


__all__ = ["NullHarness", "TallyTaskset"]
