"""Surviving actor death.

* An **engine actor** of its own (``placement.colocate = false``) that dies is replaced: a new
  actor starts in the same placement-group bundle, the trainer sends it the current weights (the
  same version the others serve), the controller's clients point at its new URL (behind
  ``rollout.engine_router`` the load balancer is told: ``remove_engine(old)``,
  ``add_engine(new)``), and the groups that were generating on it are dispatched again with the
  same prompts and sampling seeds. The run goes on; ``fault/engine_restarts`` counts the
  replacements.
* A **trainer actor** (with its colocated engine, if any) that dies ends the run with
  :class:`ActorDeathError`, naming the actor, its node and the exit cause reported by Ray; the run
  continues from its last checkpoint with ``run.resume = true``.

Engine deaths show up as failed HTTP calls (the engine's server lived in the actor), so a failed
generation or weight push asks Ray which actors are dead before deciding what to do: a failure
while every actor lives is a real error and is raised as it was.

Agent trajectories (through the AgentFlow router) do not fail with their engine: a turn whose
engine cannot be reached is sent again by the router (:data:`ROUTER_ENGINE_RETRIES` times at
most) to another engine that is up, or waits until one is; the router tells this supervisor
(:meth:`FaultSupervisor.engine_lost`), which replaces the dead engine on the run's event loop and
gives the router the new engine list. Nothing of the failed call is recorded, so the turn the
agent finally gets is token-exact. A synchronous step waits for such a replacement before it
trains (:meth:`FaultSupervisor.settle`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from loongsage_hookspecs import ReplaceableEngines, TrajectoryGroup

from ..engine_client import EngineClient
from ..errors import RunError
from .data import Prompt
from .remote import LocalActor
from .resource_errors import explain_resource_error

if TYPE_CHECKING:  # pragma: no cover
    from ..config import JobConfig
    from .placement import Actors
    from .rollout import RolloutManager

log = logging.getLogger("loongsage")

MAX_REDISPATCH = 3
"""How many times a group is dispatched again after the engine it ran on died."""

PING_TIMEOUT_S = 60.0

ROUTER_ENGINE_RETRIES = 3
"""How often the AgentFlow router sends one turn again after its engine could not be reached."""
ROUTER_ENGINE_WAIT_S = 300.0
"""How long a router turn waits for an engine to be up again (every engine down: a replacement)."""


class ActorDeathError(RunError):
    """A model actor the run cannot go on without died; the message names it, its node and why."""


def death_cause(exc: BaseException) -> str:
    """Ray's one-line reason from an ``ActorDiedError`` message (without its troubleshooting text)."""
    text = str(exc)
    marker = "The actor is dead because "
    cause = text[text.index(marker) + len(marker):] if marker in text else text.strip().splitlines()[-1]
    cause = cause.split(" Some common causes", 1)[0].strip()
    return cause.rstrip(".")


def _field(exc: BaseException, name: str) -> str:
    for line in str(exc).splitlines():
        line = line.strip()
        if line.startswith(f"{name}: "):
            return line.split(": ", 1)[1]
    return "?"


def is_actor_death(exc: BaseException) -> bool:
    import ray

    return isinstance(exc, ray.exceptions.RayActorError)


class SupervisedRun(Protocol):
    """What the supervisor needs of the run it watches (:class:`.runtime.Run` is one): its
    actors, clients and a way to push weights."""

    job: JobConfig
    output_dir: Path
    secret: str
    actors: Actors | None
    rollout: RolloutManager | None
    engine_router: Any  # the [rollout] engine_router in front of the engines, or None
    loop: asyncio.AbstractEventLoop  # the run's event loop (its engine clients belong to it)

    def push_weights(self, version: int | None = None) -> dict[str, float]: ...


class FaultSupervisor:
    """Detects dead actors for one run (a :class:`SupervisedRun`), replaces dead engines and
    explains fatal deaths."""

    def __init__(self, run: SupervisedRun) -> None:
        self.ctrl = run
        self.engine_restarts = 0
        self.retired: list[EngineClient] = []  # clients of replaced engines, to close
        self.suspect = False  # asynchronous runs: a group failed in transport; check the actors
        self._lock = threading.RLock()  # one replacement at a time (the loop's thread and workers)
        self._router_task: asyncio.Task[None] | None = None  # a replacement the router asked for
        self._router_again = False

    # ------------------------------------------------------------------ who is who

    def roles(self) -> list[tuple[str, Any, int | None]]:
        """``(description, actor, engine index if replaceable)`` for every model actor."""
        actors = self.ctrl.actors
        if actors is None:
            return []
        out: list[tuple[str, Any, int | None]] = []
        for rank, a in enumerate(actors.trainers):
            colocated = actors.colocated and a in actors.engine_actors
            out.append((f"trainer rank {rank}" + (f" (with engine {rank})" if colocated else ""), a, None))
        if not actors.colocated:
            out += [(f"engine {i}", a, i) for i, a in enumerate(actors.engine_actors)]
        return out

    def describe(self, exc: BaseException) -> str:
        """``<role> actor <id> (pid, node)`` for the actor an ``ActorDiedError`` is about."""
        actor_id = str(getattr(exc, "actor_id", "") or "")
        role = next((r for r, a, _ in self.roles()
                     if not isinstance(a, LocalActor) and a._actor_id.hex() == actor_id), "a model actor")
        return (f"{role} (Ray actor {actor_id[:12] or '?'}, pid {_field(exc, 'pid')}) on node "
                f"{_field(exc, 'ip')} died: {death_cause(exc)}")

    def dead(self) -> list[tuple[str, int | None, BaseException]]:
        """Every dead model actor: ``(role, engine index or None, the error Ray reported)``."""
        import ray

        roles = [r for r in self.roles() if not isinstance(r[1], LocalActor)]  # in-process: cannot die alone
        refs = [a.ready.remote() for _, a, _ in roles]
        found: list[tuple[str, int | None, BaseException]] = []
        for (role, _, index), ref in zip(roles, refs):
            try:
                ray.get(ref, timeout=PING_TIMEOUT_S)
            except ray.exceptions.RayActorError as exc:
                found.append((role, index, exc))
            except ray.exceptions.GetTimeoutError:
                pass  # busy, not dead
        return found

    # ------------------------------------------------------------------ recovery

    def recover(self, engines_only: bool = False) -> int:
        """Replace every dead engine (returns how many); a dead trainer ends the run
        (``engines_only``: it is left to the next call that needs it, which explains it)."""
        with self._lock:
            dead = self.dead()
            for _role, index, exc in dead:
                if index is None and not engines_only:
                    raise ActorDeathError(self._fatal_message(exc)) from None
            dead = [d for d in dead if d[1] is not None]
            for _role, index, exc in dead:
                assert index is not None
                log.warning("%s; starting a new engine %d and dispatching its requests again",
                            self.describe(exc), index)
                self._restart_engine(index)
            if dead:
                self.ctrl.push_weights()  # the new engines serve the current version, like the others
            return len(dead)

    def locked(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` while no engine is being replaced (weight pushes read the engine list)."""
        with self._lock:
            return fn(*args)

    # ------------------------------------------------------------------ the router's engines

    def attach(self, rollout: RolloutManager) -> None:
        """Let ``rollout``'s AgentFlow router retry turns whose engine died and report the engine
        here (engines that cannot be replaced alone, colocated ones, are left out)."""
        actors = self.ctrl.actors
        if actors is None or actors.colocated:
            return
        rollout.on_engine_lost = self.engine_lost
        rollout.engine_retries = ROUTER_ENGINE_RETRIES
        rollout.engine_wait_s = ROUTER_ENGINE_WAIT_S

    def engine_lost(self, url: str) -> None:
        """The router could not reach ``url`` (called on the router's thread): check and replace
        dead engines on the run's event loop, then give the router the engine list."""
        log.warning("the AgentFlow router could not reach engine %s; checking the engine actors", url)
        self.ctrl.loop.call_soon_threadsafe(self._start_router_recovery)

    def _start_router_recovery(self) -> None:
        if self._router_task is not None and not self._router_task.done():
            self._router_again = True  # another engine failed meanwhile: check once more after this
            return
        self._router_task = asyncio.ensure_future(self._router_recovery())

    async def _router_recovery(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._router_again = False
            await loop.run_in_executor(None, functools.partial(self.recover, engines_only=True))
            await self.close_retired()
            rollout = self.ctrl.rollout
            if rollout is not None and rollout.router is not None:
                # the same list when nothing died: the router tries the engine again
                await rollout.router.aset_engines(rollout.generate_urls)
            if not self._router_again:
                return

    def check(self) -> None:
        """Raise the error of a replacement the router asked for, once it ended with one."""
        task = self._router_task
        if task is not None and task.done():
            self._router_task = None
            task.result()

    async def settle(self) -> None:
        """Wait for a replacement the router asked for (its errors are raised here)."""
        while self._router_task is not None:
            task = self._router_task
            await asyncio.shield(task)
            if task is self._router_task:
                self._router_task = None

    def _fatal_message(self, exc: BaseException) -> str:
        from ..run_files import checkpoint as ckpt

        found = ckpt.latest_checkpoint(self.ctrl.output_dir)
        resume = (f"resume from checkpoint step {found[0]} with run.resume=true" if found
                  else "no checkpoint was written yet (set run.checkpoint_every to be able to resume)")
        return f"{self.describe(exc)}; the run cannot go on without it: {resume}"

    def _restart_engine(self, index: int) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .actors import ModelActor

        ctrl, actors, job = self.ctrl, self.ctrl.actors, self.ctrl.job
        assert actors is not None and ctrl.rollout is not None
        balancer = ctrl.engine_router
        if balancer is not None and not isinstance(balancer, ReplaceableEngines):
            raise RunError(f"engine {index} died and cannot be replaced behind rollout.engine_router "
                           f"'{job.rollout.engine_router}': it does not declare the ReplaceableEngines "
                           "capability (add_engine/remove_engine) to be told the new address")
        old_url = actors.engine_urls[index]
        try:
            ray.kill(actors.engine_actors[index], no_restart=True)
        except Exception:  # already gone
            pass
        pl = job.placement
        strategy = PlacementGroupSchedulingStrategy(placement_group=actors.placement_group,
                                                    placement_group_bundle_index=job.train.num_workers + index)
        remote: Any = ray.remote(ModelActor)
        actor = remote.options(num_cpus=pl.engine_cpus, num_gpus=pl.engine_gpus,
                               resources={k: float(v) for k, v in pl.engine_resources.items() if v > 0} or None,
                               scheduling_strategy=strategy).remote(job, None, 1, index, False, ctrl.secret)
        ray.get(actor.start.remote("127.0.0.1", 0))  # an engine-only actor joins no trainer group
        url = ray.get(actor.ready.remote())["engine_url"]
        actors.engine_actors[index] = actor
        actors.engine_urls[index] = url
        if balancer is not None:  # generation goes through it: route to the new engine, not the dead one
            balancer.remove_engine(old_url)
            balancer.add_engine(url)
        rollout = ctrl.rollout
        retired = rollout.clients[index]
        # the same list the phase switch (and, without an engine router, generation) uses; the
        # engine wants the run secret
        rollout.clients[index] = rollout.engine_client(url)
        if balancer is None:  # generation goes to each engine itself (behind a router: to the router)
            rollout.generate_clients[index] = rollout.clients[index]
            rollout.generate_urls[index] = url
        if rollout.router is not None:  # turns waiting for an engine go on with the new one
            rollout.router.blocking.set_engines(rollout.generate_urls)
        self.retired.append(retired)  # closed by close_retired() on the event loop
        self.engine_restarts += 1

    # ------------------------------------------------------------------ guarded calls

    async def generate(self, prompts: Sequence[Prompt], step: int, offset: int = 0) -> list[TrajectoryGroup]:
        """The step's groups like ``RolloutManager.generate``; groups lost with a dead engine are
        dispatched again (same prompt, same index, so the same sampling seeds)."""
        rollout = self.ctrl.rollout
        assert rollout is not None
        results: dict[int, TrajectoryGroup] = {}
        pending = list(range(len(prompts)))
        for attempt in range(MAX_REDISPATCH + 1):
            restarts = self.engine_restarts
            outs = await asyncio.gather(*(rollout.group(prompts[i], offset + i, step) for i in pending),
                                        return_exceptions=True)
            await self.settle()  # an engine the router found dead is replaced before the step trains
            failed, first_error = [], None
            for i, out in zip(pending, outs):
                if isinstance(out, BaseException):
                    if isinstance(out, asyncio.CancelledError) or attempt == MAX_REDISPATCH:
                        raise out
                    failed.append(i)
                    first_error = first_error or out
                else:
                    results[i] = out
            if not failed:
                break
            if self.recover() == 0 and self.engine_restarts == restarts:
                assert first_error is not None
                raise first_error  # every actor lives: a real failure, not a death
            await self.close_retired()
            pending = failed
        return [results[i] for i in range(len(prompts))]

    async def close_retired(self) -> None:
        """Close the HTTP clients of replaced engines (on the run's event loop)."""
        retired, self.retired = self.retired, []
        for client in retired:
            await client.aclose()

    async def recover_async(self) -> int:
        """:meth:`recover` from the asynchronous loop (Ray calls in a worker thread), after a group
        failed in transport (:attr:`suspect`)."""
        self.suspect = False
        restarted = await asyncio.get_running_loop().run_in_executor(None, self.recover)
        await self.close_retired()
        return restarted

    def push_weights(self, push: Callable[[], dict[str, float]]) -> dict[str, float]:
        """``push()`` (a weight sync); after an engine died meanwhile, recover and push again."""
        try:
            return self.locked(push)
        except Exception as exc:
            if is_actor_death(exc):
                raise ActorDeathError(self._fatal_message(exc)) from None
            # the sender's own error type wraps the failed POST: ask Ray whether an engine died
            if self.recover() == 0:
                raise
            return self.locked(push)

    def explain(self, exc: BaseException) -> BaseException:
        """A dead actor's error as :class:`ActorDeathError`, a full disk or an actor killed for
        memory as one line saying what to change (:mod:`.resource_errors`); other errors unchanged."""
        resource = explain_resource_error(exc, self.ctrl.output_dir)
        if resource is not None:
            return resource
        if is_actor_death(exc):
            return ActorDeathError(self._fatal_message(exc))
        return exc
