"""Running one agent trajectory end to end, for the host's controller.

:func:`run_agent_trajectory` registers the trajectory with the router, creates a sandbox from the
data row when the source has one (or the agent needs one), runs the agent against the
trajectory's OpenAI endpoint under a time limit, collects the router's record, scores the
trajectory while the sandbox still exists, always destroys the sandbox, and returns the
:class:`~loongsage_hookspecs.Trajectory` with its segments, messages, response text and status:
``completed`` when the agent returned, ``failed`` when it raised or timed out (the error is
recorded) or when its last request was refused as over-context, ``aborted`` when the host aborted
it through the router meanwhile. A failure carries its class (``Trajectory.failure``): the
policy's (``agent``) when the agent raised :class:`~loongsage_hookspecs.AgentFailure` or the
conversation outgrew the context, else the infrastructure's (``infra``: a sandbox that could not
be made, an agent or CLI that crashed or timed out, an engine the router could not reach).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Mapping

from loongsage_hookspecs import (
    Agent,
    AgentContext,
    AgentFailure,
    AgentResult,
    FailureClass,
    ReportsIsolation,
    Trajectory,
    TrajectoryStatus,
)

log = logging.getLogger(__name__)


ScoreFn = Callable[[Trajectory, Any], Awaitable[None]]
"""``await score(trajectory, sandbox)``: sets the trajectory's reward; called before teardown."""


async def run_agent_trajectory(router: Any, agent: Agent, sandbox_provider: Any = None, *, trajectory: Trajectory,
                               attempt: int = 0, sampling: Mapping[str, Any] | None = None,
                               max_response_tokens: int | None = None, max_context_length: int | None = None,
                               timeout_s: float | None = None, api_key: str | None = None,
                               needs_sandbox: bool = False, row: Mapping[str, Any] | None = None,
                               score: ScoreFn | None = None, priority: int | None = None) -> Trajectory:
    """Run ``agent`` for ``trajectory`` through ``router`` and fill in what happened.

    This is the one place of a trajectory's life: register with the router -> create the sandbox
    (from the data row) -> run the agent -> collect the router's record -> ``score`` (the rewards,
    with the sandbox still there) -> destroy the sandbox. The sandbox is destroyed however the
    steps before end: the agent raising or timing out, scoring raising, or the task being cancelled.

    Args:
        router: an :class:`~.router.AgentFlowRouter` (started) or a :class:`~.client.RouterClient`.
        agent: the agent, built (an object with ``async run(ctx)``: what binding the job's
            ``agent`` reference gives, ``ComponentRegistry.bind``).
        sandbox_provider: a ``SandboxProvider``; when given, every trajectory gets a sandbox (the
            agent works in it, and rewards may run in it); required when the agent needs one.
        trajectory: the record to fill (``id``, ``prompt``, ``label``, ``metadata`` are read).
        attempt: retry number, part of the trajectory's URL (stale attempts get 404).
        sampling, max_response_tokens, max_context_length: registered with the router.
        timeout_s: wall-clock limit of the agent run (also given to the agent as ``ctx.timeout_s``).
        needs_sandbox: the agent needs a sandbox (its spec's ``needs_sandbox``).
        api_key: what the agent sends as its API key; default: the router's key for this trajectory
            attempt (:meth:`~.router.AgentFlowRouter.trajectory_key`), which opens its endpoint only.
        row: the data row the sandbox is prepared from (default: the trajectory's prompt, label
            and metadata).
        score: called for a completed trajectory, before the sandbox is destroyed.
        priority: sent with every engine call of the trajectory (SGLang's ``priority``: larger is
            admitted sooner).
    """
    if not isinstance(agent, Agent):
        raise TypeError(f"agent {type(agent).__name__!r} has no async run(ctx) method")
    wants_sandbox = needs_sandbox or sandbox_provider is not None
    tid = trajectory.id
    base_url = await router.aregister(tid, attempt=attempt, sampling=sampling, max_response_tokens=max_response_tokens,
                                      max_context_length=max_context_length, metadata={"source": trajectory.source},
                                      priority=priority)
    if api_key is None:
        api_key = router.trajectory_key(tid, attempt)
    trajectory.status = TrajectoryStatus.GENERATING
    sandbox = None
    timing: dict[str, float] = {}
    try:
        result: AgentResult | None = None
        error: str | None = None
        policy_failed = False  # the agent raised AgentFailure: the policy's doing, not the infrastructure's
        try:
            if wants_sandbox:
                if sandbox_provider is None:
                    raise ValueError(f"agent {type(agent).__name__!r} needs a sandbox but no sandbox provider is "
                                     "configured")
                t0 = time.perf_counter()
                sandbox = await sandbox_provider.create(tid, dict(row) if row is not None else {
                    "prompt": trajectory.prompt, "label": trajectory.label, "metadata": dict(trajectory.metadata)})
                timing["sandbox_create_s"] = time.perf_counter() - t0
            ctx = AgentContext(trajectory_id=tid, base_url=base_url, api_key=api_key, prompt=trajectory.prompt,
                               label=trajectory.label, metadata=dict(trajectory.metadata),
                               sampling=dict(sampling or {}), sandbox=sandbox, timeout_s=timeout_s)
            result = await _run_with_timeout(agent.run(ctx), timeout_s)
            if result is None:
                error = f"agent timed out after {timeout_s:g}s"
            elif not isinstance(result, AgentResult):
                raise TypeError(f"agent returned {type(result).__name__}, expected AgentResult")
        except asyncio.CancelledError:
            await asyncio.shield(_collect(router, tid))
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            policy_failed = isinstance(exc, AgentFailure)
        record = await asyncio.shield(_collect(router, tid))
        _fill(trajectory, record, result, error, attempt)
        if trajectory.status == TrajectoryStatus.FAILED:
            trajectory.failure = failure_class(record, policy_failed)
        if sandbox is not None:
            trajectory.metadata["sandbox"] = _sandbox_report(sandbox_provider, timing)
        if score is not None and trajectory.status == TrajectoryStatus.COMPLETED:
            await score(trajectory, sandbox)
    finally:
        if sandbox is not None:
            t0 = time.perf_counter()
            await asyncio.shield(_destroy(sandbox_provider, sandbox, tid))
            timing["sandbox_teardown_s"] = time.perf_counter() - t0
            if isinstance(trajectory.metadata.get("sandbox"), dict):
                trajectory.metadata["sandbox"].update(timing)
    return trajectory


def speculation_of(turns: list[Any]) -> dict[str, Any]:
    """``{"speculative": counters}`` summed over the turns whose engine decoded speculatively
    (read by ``rollout/spec_*``), or nothing when none did."""
    counts = [t.speculative for t in turns if t.speculative]
    if not counts:
        return {}
    return {"speculative": {k: sum(c.get(k, 0) for c in counts) for k in counts[0]}}


def _fill(trajectory: Trajectory, record: Any, result: AgentResult | None, error: str | None, attempt: int) -> None:
    """Copy the router's record and the agent's result into ``trajectory`` and set its status."""
    trajectory.segments = record.segments if record is not None else []
    trajectory.images = dict(record.images) if record is not None else {}
    trajectory.finish_reason = record.finish_reason if record is not None else None
    trajectory.messages = (result.messages if result is not None and result.messages
                           else (record.messages if record is not None else []))
    trajectory.response_text = result.response_text if result is not None else ""
    turns = record.turns if record is not None else []
    trajectory.metadata = {**trajectory.metadata, "prefix_cache": {
        "prompt_tokens": sum(t.prompt_tokens for t in turns), "cached_tokens": sum(t.cached_tokens for t in turns)},
        **speculation_of(turns),
        "agentflow": {
        "attempt": attempt, "turns": len(turns), "segments": len(trajectory.segments),
        "tree": record.tree() if record is not None else [],
        "agent": dict(result.metadata) if result is not None else {}}}
    if record is not None and record.status == TrajectoryStatus.ABORTED:
        trajectory.status = TrajectoryStatus.ABORTED
        trajectory.error = error or "aborted by the host"
    elif error is not None:
        trajectory.status = TrajectoryStatus.FAILED
        trajectory.error = error
        trajectory.metadata["failed_in"] = "agent"
    elif record is not None and record.status == TrajectoryStatus.FAILED:  # e.g. its prompt outgrew the context
        trajectory.status = TrajectoryStatus.FAILED
        trajectory.error = record.error or "the router marked the trajectory failed"
    else:
        trajectory.status = TrajectoryStatus.COMPLETED


def failure_class(record: Any, policy_failed: bool) -> FailureClass:
    """Whose fault a failed trajectory is: the policy's when the agent said so (it raised
    :class:`~loongsage_hookspecs.AgentFailure`) or the router failed the trajectory for what the
    conversation became (over the context: the agent may then also raise on the 400 it got);
    everything else (a sandbox, an agent or CLI crash or timeout, an unreachable engine) is the
    infrastructure's."""
    router_failed = record is not None and record.status == TrajectoryStatus.FAILED
    return FailureClass.AGENT if policy_failed or router_failed else FailureClass.INFRA


def _sandbox_report(provider: Any, timing: Mapping[str, float]) -> dict[str, Any]:
    """What the trajectory's metadata says of its sandbox: isolation in force, weaknesses, timings."""
    report: dict[str, Any] = dict(timing)
    if isinstance(provider, ReportsIsolation):
        enforced = provider.enforced
        report["isolation"] = enforced.get("isolation")
        if enforced.get("warnings"):
            report["warnings"] = list(enforced["warnings"])
    return report


async def _run_with_timeout(coro: Any, timeout_s: float | None) -> Any:
    """``await coro``, or cancel it and return ``None`` after ``timeout_s``.

    Unlike ``asyncio.wait_for`` this keeps a ``TimeoutError`` raised *by the agent* (its own
    command timing out) apart from the run's time limit.
    """
    task = asyncio.ensure_future(coro)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    if not done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()


async def _destroy(provider: Any, sandbox: Any, tid: str) -> None:
    """Destroy the sandbox; never raises (a failure is logged)."""
    try:
        await provider.destroy(sandbox)
    except Exception:
        log.exception("destroying the sandbox of trajectory %s failed", tid)


async def _collect(router: Any, tid: str) -> Any:
    """Collect the router's record (aborting any generation still in flight); ``None`` if it
    cannot be read (logged)."""
    try:
        return await router.apop(tid)
    except Exception:
        log.exception("collecting trajectory %s from the router failed", tid)
        return None
