"""``loongsage run``: a run and the loop that drives it (docs/guide/training.md).

:func:`run_job` is the whole of ``loongsage run``: it builds the :class:`.runtime.Run` (actors,
engines, data, checkpoints, loggers), picks the loop, starts, trains, exports and closes.
:class:`SyncLoop` is the synchronous loop; one step, as :meth:`SyncLoop.run_step` reads::

    prompts -> agents / engines (tokens, log-probs, weight versions) -> rewards -> filters
            -> [devices to the trainer] -> learn: rows, old log-probs, advantages, train
            -> records, step health -> weights to the engines (version += 1)
            -> [devices back to the engines] -> metrics to the loggers, checkpoint

:class:`.async_loop.AsyncLoop` overlaps rollout and training instead. Both loops reach the run
through its public methods only; both filter groups with the run's one :class:`.filters.GroupFilters`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from loongsage_hookspecs import TrajectoryGroup

from ..resolve import ResolvedJob
from ..run_files.run_dir import prepare_run_dir
from ..validation import check_output_dir
from .learner import CONTROLLER_OVERHEAD
from .metrics import rollout_metrics
from .remote import waited_s
from .runtime import Run, final_evaluation


def run_job(resolved: ResolvedJob, output_dir: str | None = None, *, overwrite: bool = False,
            ) -> list[dict[str, float]]:
    """Train the resolved job; returns the metrics of every step run.

    A directory that already holds a run is continued (``run.resume = true``), moved aside
    (``overwrite``) or refused: see :mod:`loongsage_core.controller.run_dir`.
    """
    job = resolved.job
    out = Path(output_dir or job.resolve_path(job.run.output_dir))
    check_output_dir(out, "--output-dir" if output_dir else f"{job.source_path or '<job>'}: run.output_dir")
    prepare_run_dir(out, resume=job.run.resume, overwrite=overwrite, where=job.source_path or "<job>")
    run = Run(resolved, out)
    loop = make_loop(run)
    try:
        run.start()
        history = loop.fit()
        run.export_final()
        return history
    except Exception as exc:
        explained = run.faults.explain(exc)  # a dead actor: say which, where and why
        if explained is exc:
            raise
        raise explained from None
    finally:
        run.close()


def make_loop(run: Run) -> Any:
    """The loop the job asks for: :class:`.async_loop.AsyncLoop` with ``[async] enable``, else
    :class:`SyncLoop` (built before the run starts: a loop refuses a job it cannot run)."""
    if run.job.async_.enable:
        from .async_loop import AsyncLoop

        return AsyncLoop(run)
    return SyncLoop(run)


class SyncLoop:
    """Generation and training take turns: each step collects its groups, learns on them, and
    moves the new weights to the idle engines."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.job = run.job

    def fit(self) -> list[dict[str, float]]:
        """Run from the run's current step to ``train.total_steps``; returns every step's metrics."""
        run, history = self.run, []
        every = self.job.run.checkpoint_every
        while run.step < self.job.train.total_steps:
            step = run.step
            metrics = run.evaluate(step) if run.evaluation_due(step) else {}
            metrics.update(self.run_step(step))
            metrics["step"] = step
            history.append(metrics)
            run.log(step, metrics)
            run.step = step + 1
            if every > 0 and run.step % every == 0:
                run.save(run.step)
        if run.evaluation_due(run.step):  # after the last step, logged as step train.total_steps
            history.append(final_evaluation(run, run.evaluate(run.step)))
        return history

    def run_step(self, step: int) -> dict[str, float]:
        """One synchronous step: collect, learn, then move the weights to the idle engines."""
        run = self.run
        assert run.phases is not None
        t0 = time.perf_counter()
        groups, sampled, metrics = self.collect(step)
        t_rollout, waited = time.perf_counter(), waited_s()
        metrics.update(run.phases.to_training())
        train_metrics, tokens = run.learner.learn(groups, step)
        run.record(step, groups, run.learner.last_batch, sampled)
        metrics.update(train_metrics)
        metrics.update(run.health.observe(step, metrics, groups))  # raises after train.max_bad_steps
        t_train = time.perf_counter()
        if tokens and run.health.last_problem is None:
            run.version += 1
            metrics.update(run.phases.to_weight_sync())
            metrics.update(run.faults.push_weights(run.push_weights))  # replaces an engine that died
        metrics.update(run.phases.to_generation())
        t_update = time.perf_counter()
        run.record_trained(step, groups)
        metrics.update(run.learner.rollout_mfu(t_rollout - t0))
        end = time.perf_counter()
        # everything after the rollout that was not waiting on actors or engines: it holds learn()'s
        # own part (which asynchronous runs report alone) and replaces it in the metrics
        overhead = end - t_rollout - (waited_s() - waited)
        metrics.update({
            "timing/rollout": t_rollout - t0,
            "timing/train": t_train - t_rollout,
            "timing/update_weights": t_update - t_train,
            "timing/step": end - t0,
            CONTROLLER_OVERHEAD: overhead,
            "perf/controller_overhead_ratio": overhead / max(end - t0, 1e-9),
            "perf/generated_tokens": tokens,
            "perf/weight_version": float(run.version),
            "perf/tokens_per_s": tokens / max(t_rollout - t0, 1e-9),
            "fault/engine_restarts": float(run.faults.engine_restarts),
        })
        return metrics

    def collect(self, step: int) -> tuple[list[TrajectoryGroup], list[TrajectoryGroup], dict[str, float]]:
        """Generate, score and filter this step's groups (refilling dropped ones when allowed):
        the kept groups, every sampled group (the records keep the filtered-out ones too) and
        the ``rollout/*`` metrics."""
        run = self.run
        want = self.job.rollout.prompts_per_step
        kept: list[TrajectoryGroup] = []
        sampled: list[TrajectoryGroup] = []
        dropped_before = run.filters.dropped
        attempts = 0
        offset = 0
        while len(kept) < want:
            prompts = run.mixer.next_prompts(want - len(kept))
            groups = run.loop.run_until_complete(run.faults.generate(prompts, step, offset=offset))
            offset += len(prompts)
            sampled.extend(groups)
            kept.extend(run.filters.accept(groups))
            attempts += 1
            if attempts > self.job.algorithm.max_filter_retries:
                break
        metrics = rollout_metrics(sampled)
        metrics["rollout/filter_drop"] = float(run.filters.dropped - dropped_before)
        metrics["rollout/filter_attempts"] = float(attempts)
        metrics["rollout/groups_trained"] = float(len(kept))
        return kept, sampled, metrics
