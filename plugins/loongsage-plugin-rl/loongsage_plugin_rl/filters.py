"""Trajectory-group filters: ``fn(groups: list[TrajectoryGroup], **args) -> list[TrajectoryGroup]``.

The host runs the filters the job file lists, in its order, after rewards; what a filter does not
return is dropped (and counted in ``rollout/filter_drop``). Filters keep the order of the groups
they keep and never modify their input: a group that loses trajectories is returned as a new
``TrajectoryGroup`` (same ids and source) holding the remaining ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from loongsage_hookspecs import TrajectoryGroup, TrajectoryStatus

from . import _checks as chk


def _groups(owner: str, groups: Any) -> list[TrajectoryGroup]:
    if isinstance(groups, TrajectoryGroup) or not isinstance(groups, Sequence):
        raise TypeError(f"{owner}: expected a list of TrajectoryGroup, got {type(groups).__name__}")
    for i, g in enumerate(groups):
        if not isinstance(g, TrajectoryGroup):
            raise TypeError(f"{owner}: groups[{i}] is {type(g).__name__}, expected TrajectoryGroup")
    return list(groups)


def dynamic_sampling(groups: Sequence[TrajectoryGroup], *, min_spread: float = 0.0) -> list[TrajectoryGroup]:
    """DAPO dynamic sampling: keep only groups whose scores differ (``max - min > min_spread``);
    groups with all-equal scores (all correct, all wrong, a single trajectory, or empty) give a
    group-relative advantage of 0 everywhere and are dropped."""
    owner = "dynamic_sampling"
    min_spread = chk.number(owner, "min_spread", min_spread, low=0.0)
    kept = []
    for g in _groups(owner, groups):
        scores = g.scores
        if scores and max(scores) - min(scores) > min_spread:
            kept.append(g)
    return kept


def overlong(groups: Sequence[TrajectoryGroup], *, mode: str = "trajectory") -> list[TrajectoryGroup]:
    """Drop truncated generations (``finish_reason == "length"``): ``mode = "trajectory"`` removes
    those trajectories (and groups left empty), ``mode = "group"`` drops every group that holds one."""
    owner = "overlong"
    mode = chk.choice(owner, "mode", mode, ("trajectory", "group"))
    kept = []
    for g in _groups(owner, groups):
        truncated = [t.finish_reason == "length" for t in g.trajectories]
        if not any(truncated):
            if g.trajectories:
                kept.append(g)
        elif mode == "trajectory":
            rest = [t for t, cut in zip(g.trajectories, truncated, strict=True) if not cut]
            if rest:
                kept.append(attrs.evolve(g, trajectories=rest))
    return kept


_BAD_STATUS = (TrajectoryStatus.FAILED, TrajectoryStatus.ABORTED)


def status(groups: Sequence[TrajectoryGroup]) -> list[TrajectoryGroup]:
    """Drop failed and aborted trajectories, then the groups left empty."""
    kept = []
    for g in _groups("status", groups):
        rest = [t for t in g.trajectories if TrajectoryStatus(t.status) not in _BAD_STATUS]
        if not rest:
            continue
        kept.append(g if len(rest) == len(g.trajectories) else attrs.evolve(g, trajectories=rest))
    return kept
