"""``vf_notes``: write a note with a tool, scored on what the tool did.

A stateful tool environment: the taskset's MCP tool server (``vf_notes.tools``, started by
verifiers once, in a local subprocess, and shared by the rollouts) has one tool, ``bash``, which
understands ``echo TEXT > FILE`` and keeps the files it writes in the calling rollout's state
(``NotesState``, synced back to the rollout's trace over verifiers' state channel). The ``wrote_note`` reward is 1 when the task's file holds the task's text, the
``tool_calls`` metric counts the tool results. The default harness is verifiers' ``NullHarness``
(a chat loop that offers the MCP tools to the model).
"""

from __future__ import annotations

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness

from .tools import NotesState, NotesToolset


class NotesData(vf.TaskData):
    file: str
    text: str


class NotesConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()
    """Where the shared tool server runs (a local subprocess by default)."""


class NotesTask(vf.Task[NotesData, NotesState]):
    @vf.reward
    async def wrote_note(self, task: NotesData, trace: vf.Trace) -> float:
        return float(trace.state.files.get(task.file) == task.text)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


NOTES = [("hello.txt", "hello"), ("todo.txt", "milk"), ("name.txt", "loong")]


class NotesTaskset(vf.Taskset[NotesTask, NotesConfig]):
    @classmethod
    def toolsets(cls, config: NotesConfig) -> list[vf.Toolset]:
        return [NotesToolset(config.tools)]

    def load(self) -> list[NotesTask]:
        return [NotesTask(NotesData(prompt=f"Write {text} into {file}.", file=file, text=text), self.config.task)
                for file, text in NOTES]


__all__ = ["NotesTaskset", "NullHarness"]
