"""How stale a trajectory group is, measured from the weight versions of its generated tokens.

Every generated token records the policy version that produced it (``Segment.weight_versions``;
-1 marks tokens the policy did not generate: prompt, tool output, re-rendered text). When the
trainer is at version ``t`` (it has finished ``t`` steps and the engines serve weights ``t``), a
group trained now is ``t - v`` steps off-policy for a token of version ``v``. With partial rollout
one trajectory can hold several versions, so a group needs one number chosen among them:

* ``"oldest"`` (the default, and the one every bound of this package is stated in):
  ``t - min(v)``: the staleness of the group's most off-policy token. Bounding it bounds every
  token, which is what importance-sampling corrections need to stay well behaved.
* ``"newest"``: ``t - max(v)``: the staleness of the freshest token; a weaker, optimistic measure
  (a trajectory that finished under new weights counts as fresh even if it started long ago).

:func:`token_staleness_mean` gives the per-token average, a useful metric between the two.
A group without generated tokens (every trajectory failed before the first token) has staleness
0: nothing in it is off-policy.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - typing only
    from loongsage_hookspecs import TrajectoryGroup

STALENESS_MODES: tuple[str, ...] = ("oldest", "newest")
"""Accepted values of a scheduler's ``staleness`` argument."""


def generated_versions(group: "TrajectoryGroup") -> Iterator[int]:
    """Weight versions of every policy-generated token of ``group`` (the -1 entries skipped)."""
    for traj in group.trajectories:
        for seg in traj.segments:
            for v in seg.weight_versions:
                if v >= 0:
                    yield v


def check_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`STALENESS_MODES`, else a ``ValueError`` naming the choices."""
    if mode not in STALENESS_MODES:
        raise ValueError(f"staleness: unknown definition {mode!r}; choose one of {', '.join(STALENESS_MODES)}")
    return mode


def group_staleness(group: "TrajectoryGroup", trainer_version: int, mode: str = "oldest") -> int:
    """Staleness of ``group`` if trained at ``trainer_version``: ``trainer_version`` minus the oldest
    (``mode="oldest"``) or newest (``mode="newest"``) generated token's weight version; 0 when the
    group has no generated token."""
    check_mode(mode)
    versions = list(generated_versions(group))
    if not versions:
        return 0
    ref = min(versions) if mode == "oldest" else max(versions)
    return trainer_version - ref


def token_staleness_mean(groups: "list[TrajectoryGroup]", trainer_version: int) -> float:
    """Mean of ``trainer_version - v`` over every generated token of ``groups`` (0.0 if none)."""
    total = 0
    count = 0
    for g in groups:
        for v in generated_versions(g):
            total += trainer_version - v
            count += 1
    return total / count if count else 0.0
