"""Shared helpers of the rewards plugin tests."""

from __future__ import annotations

from typing import Any

import pytest

from loongsage_hookspecs import Trajectory


def make_traj(response: str, label: Any = None, metadata: dict[str, Any] | None = None) -> Trajectory:
    """A finished trajectory with the given response, label and metadata."""
    return Trajectory(id="t0", prompt_id="p0", group_id="g0", response_text=response, label=label,
                      metadata=dict(metadata or {}))


@pytest.fixture
def traj():
    return make_traj
