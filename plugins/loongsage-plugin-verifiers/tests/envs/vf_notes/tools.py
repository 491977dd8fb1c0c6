"""The ``vf_notes`` tool server: ``bash`` that only writes files, into the rollout's state."""

from __future__ import annotations

import re

import verifiers.v1 as vf
from pydantic import Field

ECHO = re.compile(r"echo\s+(?P<text>.*?)\s*>\s*(?P<file>\S+)")


class NotesState(vf.State):
    files: dict[str, str] = Field(default_factory=dict)
    """What the rollout's tool calls wrote: file name -> text."""


class NotesToolset(vf.Toolset[vf.SharedToolsetConfig, NotesState]):
    TOOL_PREFIX = None  # the tool is called plain ``bash``

    @vf.tool
    def bash(self, command: str, description: str = "") -> str:
        """Run a shell command. Only `echo TEXT > FILE` is available: it writes TEXT into FILE."""
        match = ECHO.fullmatch(command.strip())
        if match is None:
            return f"error: unsupported command {command!r}; only `echo TEXT > FILE` works"
        text = match["text"].strip().strip("'\"")
        self.state.files[match["file"]] = text
        return f"wrote {len(text)} characters to {match['file']}"


if __name__ == "__main__":
    NotesToolset.run()
