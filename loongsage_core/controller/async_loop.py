"""Fully asynchronous training: engines keep generating while the trainer trains.

Two coroutines share one event loop (and one scheduler, the job's ``[async] scheduler``):

* the **producer** dispatches prompt groups whenever the scheduler allows, and a collector files
  finished groups through the filters into the buffer;
* the **trainer** takes the scheduler's selection from the buffer, trains on it (the blocking Ray
  calls run in a worker thread so generation goes on), then updates the engines' weights:
  engines pause (``in_place`` with ``[rollout] partial = true``, so unfinished generations keep
  their tokens and continue under the new weights; ``abort`` otherwise, and the aborted prompts are
  dispatched again), receive the weights, and continue.

Every token carries the weight version that produced it; the scheduler bounds staleness by
``[async] stale_steps``. With several ``[[data]]`` sources the scheduler also keeps each step's
mix: the host gives it every step's quota per source (:class:`.mixing.StepQuotas`: floor or ceil
of each weight's share) and dispatches the source it names next, so sources with different
agents and sampling settings generate side by side and every step trains its quota of each.
Checkpoints hold the data cursor, the scheduler's state and every prompt that was drawn but not
yet trained on, so a run killed at any moment and resumed trains each prompt exactly once and
continues the same schedule.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from typing import Any, Callable

import attrs

from loongsage_hookspecs import (
    CheckpointableScheduler,
    DeadlineScheduler,
    SchedulerContext,
    SourcePicker,
    TrajectoryGroup,
    TrajectoryStatus,
)

from ..config import ConfigError, component_ref
from ..resolve import check_async_scheduler
from .data import Prompt
from .metrics import rollout_metrics
from .mixing import StepQuotas
from .rollout_ledger import RolloutLedger
from .runtime import Run, final_evaluation

log = logging.getLogger("loongsage")


def partial_ratio(groups: list[TrajectoryGroup]) -> float:
    """Fraction of trajectories whose generated tokens come from more than one weight version."""
    trajs = [t for g in groups for t in g.trajectories]
    return sum(map(_mixed_versions, trajs)) / len(trajs) if trajs else 0.0


def _mixed_versions(traj: Any) -> bool:
    """Whether the generated tokens of ``traj`` come from more than one weight version."""
    return len({v for s in traj.segments for v in s.weight_versions if v >= 0}) > 1


def per_source_metrics(groups: list[TrajectoryGroup], version: int) -> dict[str, float]:
    """``rollout_per_source/<name>/{groups,staleness_max,partial_ratio}`` of a step's trained groups
    (staleness: ``version`` minus the oldest weight version of the group's generated tokens)."""
    by_source: dict[str, list[TrajectoryGroup]] = collections.defaultdict(list)
    for g in groups:
        by_source[g.source].append(g)
    out: dict[str, float] = {}
    for name, gs in by_source.items():
        oldest = [min(vs) for g in gs
                  if (vs := [v for t in g.trajectories for s in t.segments for v in s.weight_versions if v >= 0])]
        trajs = [t for g in gs for t in g.trajectories]
        out[f"rollout_per_source/{name}/groups"] = float(len(gs))
        out[f"rollout_per_source/{name}/staleness_max"] = float(max((version - v for v in oldest), default=0))
        out[f"rollout_per_source/{name}/partial_ratio"] = sum(map(_mixed_versions, trajs)) / max(len(trajs), 1)
    return out


def group_priority(scheduler: Any, group_id: str, version: int) -> int:
    """The engine priority of a group dispatched now: earliest deadline first.

    Engines admit requests of a larger priority first (SGLang's convention), so a group gets its
    deadline negated: the last trainer version allowed to train it, when the scheduler gives one
    (a :class:`~loongsage_hookspecs.DeadlineScheduler`), else the version it is dispatched at
    (oldest first). A step waits for the groups due at its version; the engines finish those
    before they start the next step's, and the embedded engine, with ``strict_priority``, decodes
    them in a batch of their own.
    """
    deadline = scheduler.deadline_of(group_id) if isinstance(scheduler, DeadlineScheduler) else None
    return -(version if deadline is None else int(deadline))


class AsyncLoop:
    """The RL loop with rollout and training overlapped (``[async] enable = true``) over a
    :class:`.runtime.Run`, which it reaches through its public methods."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.job = job = run.job
        where = job.source_path or "<job>"
        if job.placement.colocate:
            raise ConfigError(f"{where}: async.enable = true needs placement.colocate = false (the trainer and "
                              "the engines must run at the same time on separate actors)")
        spec = check_async_scheduler(job, self.run.host)
        quota: Callable[[int], dict[str, int]] | None = None
        if spec.declares(SourcePicker):  # the per-source quotas go to a scheduler that keeps them
            names = [src.name for src in job.data]
            quotas = StepQuotas([src.weight for src in job.data], job.rollout.prompts_per_step)

            def quota(version: int) -> dict[str, int]:
                return dict(zip(names, quotas(version)))
        ref = component_ref(job, "async.scheduler")
        ctx = SchedulerContext(where=ref.where, job=job, components=self.run.host,
                               batch_size=job.rollout.prompts_per_step, stale_steps=job.async_.stale_steps,
                               quota=quota)
        self.scheduler = self.run.host.bind(ref, ctx)
        self.quota_mode = quota is not None  # the scheduler names the source of every dispatch
        self.requeue: collections.deque[Prompt] = collections.deque()
        self.inflight: dict[str, tuple[asyncio.Task[TrajectoryGroup], Prompt]] = {}
        self.buffer: list[TrajectoryGroup] = []
        self.group_prompts: dict[str, Prompt] = {}
        self.dispatched = 0
        self.changed = asyncio.Event()
        self.discarded = 0
        self.ledger = RolloutLedger()  # waste and sampled vs trained lengths, run totals
        self.stopping = False
        self.updating = False

    # ------------------------------------------------------------------ checkpoints

    def restore(self) -> None:
        """After the run resumed from a checkpoint: its prompts drawn but not trained yet go first,
        and the scheduler continues its schedule."""
        state = self.run.resumed_state
        if state is None:
            return
        for p in state.get("pending_prompts", []):
            self.requeue.append(Prompt(**p))
        saved = state.get("scheduler")
        if saved is not None and isinstance(self.scheduler, CheckpointableScheduler):
            self.scheduler.load_state_dict(saved)

    def pending_prompts(self) -> list[Prompt]:
        """Prompts drawn from the data but not trained yet: re-queued, generating, buffered."""
        pending = list(self.requeue)
        pending += [p for _, p in self.inflight.values()]
        pending += [self.group_prompts[g.group_id] for g in self.buffer]
        return pending

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of this loop (besides the run's): the pending prompts and the
        scheduler's state."""
        state: dict[str, Any] = {"pending_prompts": [attrs.asdict(p) for p in self.pending_prompts()]}
        if isinstance(self.scheduler, CheckpointableScheduler):
            state["scheduler"] = dict(self.scheduler.state_dict())
        return state

    # ------------------------------------------------------------------ producer

    def _next_prompt(self, source: str | None = None) -> Prompt:
        """A re-queued prompt first (of ``source``, when the scheduler names one), else a new one."""
        if source is None:
            return self.requeue.popleft() if self.requeue else self.run.mixer.next_prompts(1)[0]
        for i, p in enumerate(self.requeue):
            if p.source == source:
                del self.requeue[i]
                return p
        return self.run.mixer.next_from(source)

    def _dispatch(self) -> None:
        assert self.run.rollout is not None
        picker = self.scheduler if self.quota_mode and isinstance(self.scheduler, SourcePicker) else None
        while self.scheduler.can_dispatch(len(self.inflight), len(self.buffer), self.run.version):
            source = picker.next_source(self.run.version) if picker is not None else None
            if source is None and self.quota_mode:
                break  # pragma: no cover - can_dispatch and next_source agree for the shipped schedulers
            prompt = self._next_prompt(source)
            index = self.dispatched
            self.dispatched += 1
            group_id = f"{self.run.version}:{index}"
            if source is None:
                self.scheduler.on_dispatch(group_id, self.run.version)
            else:
                self.scheduler.on_dispatch(group_id, self.run.version, source=source)
            priority = group_priority(self.scheduler, group_id, self.run.version)
            task = asyncio.ensure_future(self.run.rollout.group(prompt, index, self.run.version, priority=priority))
            self.inflight[group_id] = (task, prompt)
            task.add_done_callback(functools.partial(self._on_done, group_id))

    def _collect(self, group_id: str, task: asyncio.Task[TrajectoryGroup]) -> None:
        """File a finished group: into the buffer, or back to the queue, or dropped by a filter."""
        _, prompt = self.inflight.pop(group_id)
        self.changed.set()
        if task.cancelled() or task.exception() is not None:
            if task.cancelled() and not self.stopping:
                self.ledger.aborted()
            if not task.cancelled():
                log.warning("group %s failed: %r; its prompt is dispatched again", group_id, task.exception())
                self.run.faults.suspect = True  # a dead engine? _run asks Ray before dispatching again
            self.scheduler.on_discard(group_id)
            self.requeue.append(prompt)
            return
        group = task.result()
        group.group_id = group_id
        self.ledger.finished(group)
        if any(t.status == TrajectoryStatus.ABORTED for t in group.trajectories):
            # aborted at a weight update (partial = false): generate the prompt again
            self.ledger.dropped(group)
            self.scheduler.on_discard(group_id)
            self.requeue.append(prompt)
            return
        if not self.run.filters.accept([group]):
            self.discarded += 1
            self.ledger.dropped(group)
            self.scheduler.on_discard(group_id)
            return
        self.group_prompts[group_id] = prompt
        self.scheduler.on_complete(group)
        self.buffer.append(group)

    def _on_done(self, group_id: str, task: asyncio.Task[TrajectoryGroup]) -> None:
        self._collect(group_id, task)
        if not (self.stopping or self.updating or self.run.faults.suspect):
            self._dispatch()  # a finished group frees a place: keep the engines busy

    async def _abort_unusable(self) -> None:
        assert self.run.rollout is not None
        for gid in self.scheduler.to_abort(self.run.version):
            entry = self.inflight.get(gid)
            if entry is not None:
                entry[0].cancel()
        for group in self.scheduler.evict(self.buffer, self.run.version):
            self.buffer.remove(group)
            self.ledger.dropped(group)
            self.requeue.append(self.group_prompts.pop(group.group_id))

    # ------------------------------------------------------------------ trainer

    async def _update_weights(self, version: int) -> dict[str, float]:
        """Pause the engines, push the weights of ``version``, continue.

        Nothing is dispatched meanwhile: the scheduler learns the new version only once the
        engines serve it.
        """
        assert self.run.rollout is not None
        mode = "in_place" if self.job.rollout.partial else "abort"
        t0 = time.perf_counter()
        self.updating = True
        await asyncio.gather(*(c.pause(mode) for c in self.run.rollout.clients))
        loop = asyncio.get_running_loop()
        try:
            stats = await loop.run_in_executor(None, self.run.faults.locked, self.run.push_weights, version)
        finally:
            await asyncio.gather(*(c.resume() for c in self.run.rollout.clients))
            self.updating = False
        stats["timing/update_weights"] = time.perf_counter() - t0
        return stats

    async def _train_step(self, groups: list[TrajectoryGroup], waited: float, t0: float) -> dict[str, float]:
        loop = asyncio.get_running_loop()
        step = self.run.step
        metrics = rollout_metrics(groups)
        metrics["rollout/partial_ratio"] = partial_ratio(groups)
        metrics.update(per_source_metrics(groups, self.run.version))
        t_train = time.perf_counter()
        train_metrics, tokens = await loop.run_in_executor(None, self.run.learner.learn, groups, step)
        self.run.record(step, groups, self.run.learner.last_batch)
        metrics.update(train_metrics)
        metrics.update(self.run.health.observe(step, metrics, groups))  # raises after train.max_bad_steps
        metrics["timing/train"] = time.perf_counter() - t_train
        if tokens and self.run.health.last_problem is None:
            if self.run.faults.suspect:
                await self.run.faults.recover_async()  # the weights must reach a live engine set
            try:
                update = await self._update_weights(self.run.version + 1)
            except Exception:
                self.updating = False
                if await self.run.faults.recover_async() == 0:  # no engine died: a real failure
                    raise
                update = await self._update_weights(self.run.version + 1)
            metrics.update(update)
        else:
            # A skipped (bad) step still ends with a new version, the only way the scheduler closes
            # the step's batch. No weights move (the trainer's equal the engines': rolled back or
            # never changed); the engines only tag what they generate from now on with it.
            assert self.run.rollout is not None
            await asyncio.gather(*(c.update_weight_version(self.run.version + 1) for c in self.run.rollout.clients))
        self.run.version += 1
        self.scheduler.on_train_step(self.run.version)
        for g in groups:
            self.group_prompts.pop(g.group_id, None)
        self.run.record_trained(step, groups)
        self.ledger.trained(groups)
        metrics.update(self.scheduler.metrics())
        metrics.update(self.ledger.metrics())
        step_time = time.perf_counter() - t0
        metrics.update({
            "rollout/pipeline_buf_size": float(len(self.buffer)),
            "rollout/in_flight": float(len(self.inflight)),
            "rollout/filter_drop": float(self.discarded),
            "timing/wait": waited,
            "timing/step": step_time,
            "perf/wait_ratio": waited / max(step_time, 1e-9),
            # the learn phase's own work (the event loop's thread runs rollouts beside the rest)
            "perf/controller_overhead_ratio": metrics.get("timing/controller_overhead", 0.0) / max(step_time, 1e-9),
            "perf/generated_tokens": tokens,
            "perf/weight_version": float(self.run.version),
            "fault/engine_restarts": float(self.run.faults.engine_restarts),
        })
        return metrics

    async def _run(self) -> list[dict[str, float]]:
        history: list[dict[str, float]] = []
        every = self.job.run.checkpoint_every
        t0 = time.perf_counter()
        waited = 0.0
        while self.run.step < self.job.train.total_steps:
            self.run.faults.check()  # a replacement the router asked for failed: the run cannot go on
            if self.run.faults.suspect:
                await self.run.faults.recover_async()  # replace dead engines, then dispatch again
            await self._abort_unusable()
            groups = self.scheduler.select(self.buffer, self.run.version, self.job.rollout.prompts_per_step)
            if groups is None:
                if not self.run.faults.suspect:
                    self._dispatch()
                if not self.inflight and not self.buffer and not self.run.faults.suspect:
                    raise RuntimeError("async loop stalled: nothing in flight and nothing buffered")
                self.changed.clear()
                t_wait = time.perf_counter()
                if not self.run.faults.suspect:
                    await self.changed.wait()
                waited += time.perf_counter() - t_wait
                continue
            for g in groups:
                self.buffer.remove(g)
            self._dispatch()  # keep the engines busy while the trainer works
            step = self.run.step
            evaluated = await self.run.evaluate_async(step) if self.run.evaluation_due(step) else {}
            metrics = await self._train_step(list(groups), waited, t0)
            metrics.update(evaluated)
            metrics["step"] = step
            history.append(metrics)
            self.run.log(self.run.step, metrics)
            self.run.step += 1
            if every > 0 and self.run.step % every == 0:
                self.run.save(self.run.step, self.checkpoint_state())
            t0 = time.perf_counter()
            waited = 0.0
        self.stopping = True
        for task, _ in list(self.inflight.values()):
            task.cancel()
        await asyncio.gather(*(t for t, _ in list(self.inflight.values())), return_exceptions=True)
        if self.run.evaluation_due(self.run.step):  # after the last step, on engines that train no more
            history.append(final_evaluation(self.run, await self.run.evaluate_async(self.run.step)))
        return history

    def fit(self) -> list[dict[str, float]]:
        """Train from the run's current step to ``train.total_steps``; every step's metrics."""
        self.restore()
        return self.run.loop.run_until_complete(self._run())
