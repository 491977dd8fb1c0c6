"""Running one agent trajectory end to end, for the host's controller.

:func:`run_agent_trajectory` registers the trajectory with the router, creates a sandbox when
the agent needs one, runs the agent against the trajectory's OpenAI endpoint under a time limit,
always destroys the sandbox and collects the router's record, and returns the
:class:`~loongsage_hookspecs.Trajectory` with its segments, messages, response text and status:
``completed`` when the agent returned, ``failed`` when it raised or timed out (the error is
recorded) or when its last request was refused as over-context, ``aborted`` when the host aborted
it through the router meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Mapping

from loongsage_hookspecs import AgentContext, AgentResult, Trajectory, TrajectoryStatus

log = logging.getLogger(__name__)


def build_agent(agent: Any, agent_args: Mapping[str, Any] | None) -> tuple[Any, bool]:
    """``(agent object, needs_sandbox)`` from an :class:`AgentSpec` (+ args) or a built agent."""
    factory = getattr(agent, "factory", None)
    if factory is not None:
        obj = factory(**dict(agent_args or {}))
        needs = bool(getattr(agent, "needs_sandbox", False))
    else:
        obj, needs = agent, False
    if not callable(getattr(obj, "run", None)):
        raise TypeError(f"agent {getattr(agent, 'name', type(obj).__name__)!r} has no async run(ctx) method")
    return obj, needs


async def run_agent_trajectory(router: Any, agent: Any, agent_args: Mapping[str, Any] | None = None,
                               sandbox_provider: Any = None, *, trajectory: Trajectory, attempt: int = 0,
                               sampling: Mapping[str, Any] | None = None, max_response_tokens: int | None = None,
                               max_context_length: int | None = None, timeout_s: float | None = None,
                               api_key: str | None = None, needs_sandbox: bool | None = None) -> Trajectory:
    """Run ``agent`` for ``trajectory`` through ``router`` and fill in what happened.

    Args:
        router: an :class:`~.router.AgentFlowRouter` (started) or a :class:`~.client.RouterClient`.
        agent: an ``AgentSpec`` (built with ``agent_args``) or an agent object with ``async run(ctx)``.
        sandbox_provider: a ``SandboxProvider``; required when the agent needs a sandbox.
        trajectory: the record to fill (``id``, ``prompt``, ``label``, ``metadata`` are read).
        attempt: retry number, part of the trajectory's URL (stale attempts get 404).
        sampling, max_response_tokens, max_context_length: registered with the router.
        timeout_s: wall-clock limit of the agent run (also given to the agent as ``ctx.timeout_s``).
        needs_sandbox: override the spec's ``needs_sandbox``.
        api_key: what the agent sends as its API key; default: the router's key for this trajectory
            attempt (:meth:`~.router.AgentFlowRouter.trajectory_key`), which opens its endpoint only.
    """
    obj, spec_needs = build_agent(agent, agent_args)
    wants_sandbox = spec_needs if needs_sandbox is None else needs_sandbox
    tid = trajectory.id
    base_url = await router.aregister(tid, attempt=attempt, sampling=sampling, max_response_tokens=max_response_tokens,
                                      max_context_length=max_context_length, metadata={"source": trajectory.source})
    if api_key is None:
        key_for = getattr(router, "trajectory_key", None)
        api_key = key_for(tid, attempt) if callable(key_for) else "loongsage"
    trajectory.status = TrajectoryStatus.GENERATING
    sandbox = None
    result: AgentResult | None = None
    error: str | None = None
    try:
        if wants_sandbox:
            if sandbox_provider is None:
                raise ValueError(f"agent {getattr(agent, 'name', type(obj).__name__)!r} needs a sandbox but no "
                                 "sandbox provider is configured")
            sandbox = await sandbox_provider.create(tid)
        ctx = AgentContext(trajectory_id=tid, base_url=base_url, api_key=api_key, prompt=trajectory.prompt,
                           label=trajectory.label, metadata=dict(trajectory.metadata), sampling=dict(sampling or {}),
                           sandbox=sandbox, timeout_s=timeout_s)
        result = await _run_with_timeout(obj.run(ctx), timeout_s)
        if result is None:
            error = f"agent timed out after {timeout_s:g}s"
        elif not isinstance(result, AgentResult):
            raise TypeError(f"agent returned {type(result).__name__}, expected AgentResult")
    except asyncio.CancelledError:
        await asyncio.shield(_cleanup(router, tid, sandbox_provider, sandbox))
        raise
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    record = await asyncio.shield(_cleanup(router, tid, sandbox_provider, sandbox))
    trajectory.segments = record.segments if record is not None else []
    trajectory.finish_reason = record.finish_reason if record is not None else None
    trajectory.messages = (result.messages if result is not None and result.messages
                           else (record.messages if record is not None else []))
    trajectory.response_text = result.response_text if result is not None else ""
    turns = record.turns if record is not None else []
    trajectory.metadata = {**trajectory.metadata, "prefix_cache": {
        "prompt_tokens": sum(t.prompt_tokens for t in turns), "cached_tokens": sum(t.cached_tokens for t in turns)},
        "agentflow": {
        "attempt": attempt, "turns": len(record.turns) if record is not None else 0,
        "segments": len(trajectory.segments), "agent": dict(result.metadata) if result is not None else {}}}
    if record is not None and record.status == TrajectoryStatus.ABORTED:
        trajectory.status = TrajectoryStatus.ABORTED
        trajectory.error = error or "aborted by the host"
    elif error is not None:
        trajectory.status = TrajectoryStatus.FAILED
        trajectory.error = error
    elif record is not None and record.status == TrajectoryStatus.FAILED:  # e.g. its prompt outgrew the context
        trajectory.status = TrajectoryStatus.FAILED
        trajectory.error = record.error or "the router marked the trajectory failed"
    else:
        trajectory.status = TrajectoryStatus.COMPLETED
    return trajectory


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


async def _cleanup(router: Any, tid: str, provider: Any, sandbox: Any) -> Any:
    """Destroy the sandbox and collect the record (aborting any generation still in flight).

    Never raises: failures are logged and ``None`` stands for a record that could not be read.
    """
    if sandbox is not None:
        try:
            await provider.destroy(sandbox)
        except Exception:
            log.exception("destroying the sandbox of trajectory %s failed", tid)
    try:
        return await router.apop(tid)
    except Exception:
        log.exception("collecting trajectory %s from the router failed", tid)
        return None
