"""Scoring finished trajectories with the rewards their data source lists.

A source may list several rewards; the trajectory's score is their sum and each one's details
are kept under ``<reward>/<key>``. A reward function that raises does not stop the run: the
trajectory is marked failed with the error recorded (and is not trained on).
"""

from __future__ import annotations

import logging
from typing import Any

from loongsage_hookspecs import Reward, Trajectory, TrajectoryStatus

from ..config import DataConfig

log = logging.getLogger(__name__)


def score_trajectory(traj: Trajectory, source: DataConfig, components: Any) -> None:
    """Set ``traj.reward`` (and mark it failed if a reward function raises)."""
    total = 0.0
    details: dict[str, float] = {}
    parts: dict[str, Reward] = {}
    for name in source.reward:
        spec = components.get("reward", name)
        args = source.reward_args.get(name, {})
        try:
            out = spec.fn(traj, **args)
        except Exception as exc:  # user reward code may raise anything; record it, keep running
            message = f"reward '{name}' raised {type(exc).__name__}: {exc}"
            log.warning("trajectory %s: %s", traj.id, message)
            parts[name] = Reward(score=0.0, error=message, reason=message)
            traj.reward = Reward(score=0.0, details=details, error=message, reason=message, components=parts)
            traj.status = TrajectoryStatus.FAILED
            traj.error = message
            return
        reward = out if isinstance(out, Reward) else Reward(score=float(out))
        parts[name] = reward
        total += float(reward.score)
        details[f"{name}/score"] = float(reward.score)
        details.update({f"{name}/{k}": float(v) for k, v in reward.details.items()})
    reason = "; ".join(f"{n}: {r.reason}" for n, r in parts.items() if r.reason)
    traj.reward = Reward(score=total, details=details, reason=reason, components=parts)
