"""Failing loudly: steps that train nothing or produce non-finite numbers.

After each step's training the controller asks :class:`StepHealth` whether the step was *bad*:

* a non-finite ``train/loss``, ``train/pg_loss`` or ``train/grad_norm``, or an optimizer step the
  backend skipped (``train/skipped_step``) — the backend leaves its weights as they were;
* an optimizer step whose update made weights non-finite (``train/nonfinite_weights``) and that
  the backend took back (``train/rolled_back_step``: the torch backend restores the parameters
  and optimizer state of before the step);
* weights that became non-finite and were *not* taken back (a backend that cannot, or
  ``rollback_overflow = false``): the run ends at once, before they reach the engines;
* zero rows or zero tokens trained although groups were collected (every trajectory failed, every
  generation was empty), with the cause — e.g. the reward's exception text — in the message;
* every trajectory failed, even where some were trained on with reward 0 (the policy's own
  failures, or ``[algorithm] infra_failures = "zero_reward"``): a step of nothing but failures.

A bad step is skipped (no new weight version, nothing sent to the engines), counted
(``fault/bad_steps``, ``fault/bad_step``) and logged; ``train.max_bad_steps`` bad steps in a row
end the run with :class:`TrainingFailedError` (exit 1 from the CLI). A step whose filters dropped
every group is not bad: it had nothing to learn from, which is the filters' job.
"""

from __future__ import annotations

import collections
import logging
import math
from typing import Mapping, Sequence

from loongsage_hookspecs import TrajectoryGroup, TrajectoryStatus

from ..errors import RunError

log = logging.getLogger("loongsage")

FINITE_KEYS = ("train/loss", "train/pg_loss", "train/grad_norm")


class TrainingFailedError(RunError):
    """Training stopped making progress (non-finite numbers, nothing trained); names the cause."""


def failure_causes(groups: Sequence[TrajectoryGroup]) -> str:
    """Why the trajectories of ``groups`` gave nothing to train: their most common errors."""
    trajs = [t for g in groups for t in g.trajectories]
    if not trajs:
        return "no trajectory was generated"
    failed = [t for t in trajs if t.status == TrajectoryStatus.FAILED]
    if failed:
        errors = collections.Counter(t.error or "no error recorded" for t in failed)
        text, count = errors.most_common(1)[0]
        more = f" (and {len(errors) - 1} other errors)" if len(errors) > 1 else ""
        return f"{len(failed)} of {len(trajs)} trajectories failed, {count} with: {text}{more}"
    if all(t.response_length == 0 for t in trajs):
        return f"all {len(trajs)} generations were empty (no generated token)"
    aborted = sum(t.status == TrajectoryStatus.ABORTED for t in trajs)
    if aborted:
        return f"{aborted} of {len(trajs)} trajectories were aborted"
    return "no row had a generated token to train on"


def diagnose(metrics: Mapping[str, float], groups: Sequence[TrajectoryGroup]) -> str | None:
    """What makes this step bad (``None``: nothing)."""
    for key in FINITE_KEYS:
        value = metrics.get(key)
        if value is not None and not math.isfinite(value):
            return f"{key} is {value}"
    if metrics.get("train/rolled_back_step", 0.0) > 0:
        return (f"train/rolled_back_step: the optimizer step overflowed the weights "
                f"(train/nonfinite_weights = {metrics.get('train/nonfinite_weights')}, train/lr = "
                f"{metrics.get('train/lr')}) and was rolled back")
    if metrics.get("train/skipped_step", 0.0) > 0:
        return "the optimizer step was skipped: train/grad_norm was not finite"
    rows = metrics.get("rollout/num_rows", 0.0)
    if rows == 0:
        if groups:
            return f"trained zero rows: {failure_causes(groups)}"
        if metrics.get("rollout/failed_ratio", 0.0) >= 1.0:
            return "trained zero rows: every trajectory failed (and was filtered out)"
        return None  # the filters dropped every group: nothing to learn, not a fault
    trajs = [t for g in groups for t in g.trajectories]
    if trajs and all(t.status == TrajectoryStatus.FAILED for t in trajs):  # trained with reward 0 only
        return f"every trajectory failed: {failure_causes(groups)}"
    if metrics.get("train/num_mini_batches", 1.0) == 0:
        return f"trained zero tokens: {failure_causes(groups)}"
    return None


class StepHealth:
    """Counts bad steps in a row and ends the run after ``max_bad_steps`` of them."""

    def __init__(self, max_bad_steps: int) -> None:
        self.max_bad_steps = max_bad_steps
        self.consecutive = 0
        self.total = 0
        self.last_problem: str | None = None

    def observe(self, step: int, metrics: Mapping[str, float], groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
        """Judge ``step``; returns its ``fault/*`` metrics, raises when the run must end.

        After this call :attr:`last_problem` says whether the step must be skipped (no weight
        update).
        """
        if metrics.get("train/nonfinite_weights", 0.0) > 0 and not metrics.get("train/rolled_back_step", 0.0) > 0:
            raise TrainingFailedError(
                f"step {step}: the weights became non-finite after the optimizer step "
                f"({int(metrics['train/nonfinite_weights'])} tensors; train/grad_norm = "
                f"{metrics.get('train/grad_norm')}, train/lr = {metrics.get('train/lr')}) and the train backend did "
                "not roll the step back; the run stops before they reach the engines: lower train.lr or set "
                "train.grad_clip, and resume from the last checkpoint")
        problem = diagnose(metrics, groups)
        self.last_problem = problem
        if problem is None:
            self.consecutive = 0
        else:
            self.consecutive += 1
            self.total += 1
            log.warning("step %d skipped (bad step %d of %d allowed in a row): %s", step, self.consecutive,
                        self.max_bad_steps, problem)
            if self.consecutive >= self.max_bad_steps:
                raise TrainingFailedError(
                    f"{self.consecutive} bad steps in a row (train.max_bad_steps = {self.max_bad_steps}); "
                    f"step {step}: {problem}")
        return {"fault/bad_step": 0.0 if problem is None else 1.0, "fault/bad_steps": float(self.total)}
