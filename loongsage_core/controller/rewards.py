"""Scoring finished trajectories with the rewards their data source lists.

A source may list several rewards; the trajectory's score is their sum and each one's details
are kept under ``<reward>/<key>``. Rewards run off the event loop, in a worker thread of their
own, under the source's ``reward_timeout_s``: a reward that raises or does not return in time
does not stop the run, the trajectory is marked failed with the error recorded (and is not trained
on); so is one that returns no usable number (``nan``, ``None``, ``'yes'``: :mod:`.reward_values`).
A reward whose spec has ``needs_sandbox`` gets ``sandbox=`` (the trajectory's sandbox, still alive:
the caller destroys it after scoring).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Sequence

import attrs

from loongsage_hookspecs import ComponentRegistry, FailureClass, Reward, Trajectory, TrajectoryStatus

from ..config import DataConfig, JobConfig, section_refs
from .reward_values import checked_reward, reward_failure

log = logging.getLogger(__name__)


@attrs.define(frozen=True)
class SourceRewards:
    """One data source's rewards, bound (job-file order), and its time limit for scoring."""

    functions: Sequence[Any]
    timeout_s: float

    @classmethod
    def bind(cls, job: JobConfig, source: DataConfig, key: str, components: ComponentRegistry) -> "SourceRewards":
        """The rewards of ``source`` (the ``[[data]]``-shaped table of ``job`` at job-file ``key``,
        e.g. ``data[0]``), bound through ``components``."""
        refs = [r for r in section_refs(source, key, job) if r.kind == "reward"]
        return cls(functions=[components.bind(ref) for ref in refs], timeout_s=source.reward_timeout_s)

    @property
    def names(self) -> list[str]:
        return [fn.name for fn in self.functions]


def compute_reward(traj: Trajectory, rewards: SourceRewards, sandbox: Any = None) -> tuple[Reward, str | None]:
    """``(reward, error)`` of ``traj`` (``error``: the first reward that raised); touches nothing."""
    total = 0.0
    details: dict[str, float] = {}
    parts: dict[str, Reward] = {}
    for fn in rewards.functions:
        name = fn.name
        try:
            reward = checked_reward(name, fn(traj, sandbox=sandbox) if fn.spec.needs_sandbox else fn(traj))
        except Exception as exc:  # user reward code may raise anything; record it, keep running
            message = reward_failure(name, exc)
            parts[name] = Reward(score=0.0, error=message, reason=message)
            return Reward(score=0.0, details=details, error=message, reason=message, components=parts), message
        parts[name] = reward
        total += float(reward.score)
        details[f"{name}/score"] = float(reward.score)
        details.update({f"{name}/{k}": float(v) for k, v in reward.details.items()})
    reason = "; ".join(f"{n}: {r.reason}" for n, r in parts.items() if r.reason)
    return Reward(score=total, details=details, reason=reason, components=parts), None


def _apply(traj: Trajectory, reward: Reward, error: str | None) -> None:
    traj.reward = reward
    if error is not None:
        log.warning("trajectory %s: %s", traj.id, error)
        traj.status = TrajectoryStatus.FAILED
        traj.error = error
        traj.failure = FailureClass.INFRA  # the reward broke, not the policy
        traj.metadata["failed_in"] = "reward"


def score_trajectory(traj: Trajectory, rewards: SourceRewards, sandbox: Any = None) -> None:
    """Set ``traj.reward`` here and now (and mark it failed if a reward function raises)."""
    _apply(traj, *compute_reward(traj, rewards, sandbox))


async def score_trajectory_async(traj: Trajectory, rewards: SourceRewards, sandbox: Any = None,
                                 timeout_s: float | None = None) -> None:
    """:func:`score_trajectory` in a worker thread, waiting at most ``timeout_s`` (default: the
    source's ``reward_timeout_s``). Past it the trajectory is failed; the thread is left to finish
    on its own and what it computes is dropped (a reward stuck in a sandbox command ends when the
    caller destroys the sandbox)."""
    timeout = rewards.timeout_s if timeout_s is None else timeout_s
    loop = asyncio.get_running_loop()
    future: asyncio.Future[tuple[Reward, str | None]] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)

    def work() -> None:
        value, error = None, None
        try:
            value = compute_reward(traj, rewards, sandbox)
        except BaseException as exc:  # handed to the waiting task
            error = exc
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop is gone: nobody waits any more
            pass

    threading.Thread(target=work, name=f"reward-{traj.id}", daemon=True).start()
    try:
        reward, error = await asyncio.wait_for(asyncio.shield(future), timeout)
    except asyncio.TimeoutError:
        message = f"rewards {', '.join(rewards.names)} did not finish within {timeout:g}s (reward_timeout_s)"
        reward, error = Reward(score=0.0, error=message, reason=message), message
    _apply(traj, reward, error)
