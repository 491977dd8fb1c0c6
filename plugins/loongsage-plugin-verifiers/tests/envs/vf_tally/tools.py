"""The ``vf_tally`` tool server: ``add``, which adds to the calling rollout's tally."""

from __future__ import annotations

import verifiers.v1 as vf


class TallyState(vf.State):
    total: int = 0
    """The rollout's tally."""


class TallyToolset(vf.Toolset[vf.SharedToolsetConfig, TallyState]):
    TOOL_PREFIX = None  # the tool is called plain ``add``

    @vf.tool
    def add(self, amount: int = 1) -> str:
        """Add amount (default 1) to the tally and return the new total."""
        self.state.total += amount
        return f"total: {self.state.total}"


if __name__ == "__main__":
    TallyToolset.run()
