"""Metric helpers the host (or a user hook) can call on rollout groups and advantages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from loongsage_hookspecs import TrajectoryGroup

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


def rollout_group_metrics(groups: Sequence[TrajectoryGroup], correct_threshold: float = 1.0) -> dict[str, float]:
    """Share of non-empty groups whose trajectories are all correct (every score
    ``>= correct_threshold``) or all wrong (every score below it): ``rollout/all_correct_ratio``
    and ``rollout/all_wrong_ratio``. Both are 0.0 when there is no non-empty group."""
    if isinstance(correct_threshold, bool) or not isinstance(correct_threshold, (int, float)):
        raise TypeError(f"rollout_group_metrics: correct_threshold must be a number, got {correct_threshold!r}")
    n = all_correct = all_wrong = 0
    for i, g in enumerate(groups):
        if not isinstance(g, TrajectoryGroup):
            raise TypeError(f"rollout_group_metrics: groups[{i}] is {type(g).__name__}, expected TrajectoryGroup")
        if not g.trajectories:
            continue
        n += 1
        correct = [s >= correct_threshold for s in g.scores]
        all_correct += all(correct)
        all_wrong += not any(correct)
    return {
        "rollout/all_correct_ratio": all_correct / n if n else 0.0,
        "rollout/all_wrong_ratio": all_wrong / n if n else 0.0,
    }


def adv_zero_ratio(advantages: "torch.Tensor", mask: "torch.Tensor") -> float:
    """Share of trained tokens whose advantage is exactly 0 (no learning signal)."""
    trained = mask != 0
    n = int(trained.sum())
    return float((advantages[trained] == 0).sum()) / n if n else 0.0
