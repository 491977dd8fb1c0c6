"""Start, resume, checkpoint and close a run: everything of :class:`.run.RLController` around the
steps.

* :meth:`RunLifecycle.start`: the run directory's files, the Ray cluster, the model actors, the
  critic and the teachers in one placement group, the engine router, the rollout manager, resume, the loggers.
* :meth:`RunLifecycle.save`: a checkpoint (trainer ranks, critic ranks, then ``controller.json``,
  which completes it); resume reads it back (:meth:`RunLifecycle._maybe_resume`).
* :meth:`RunLifecycle.close`: everything :meth:`start` started, in reverse.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from loongsage_hookspecs import LoggerContext, StepTruncation

from ..config import ConfigError, JobConfig, component_refs, dump_job_toml
from ..records.writer import recorder_for_run
from ..security import set_process_secret, write_secret_file
from . import checkpoint as ckpt
from .colocation import PhaseSwitch
from .critic import Critic
from .placement import create_actors, init_ray, start_engine_router
from .remote import gather
from .rollout import RolloutManager
from .run_dir import truncate_jsonl
from .signals import restore_signals, stop_on_signals
from .state import RunState
from .step import TRAINED_PROMPTS
from .teacher_actor import Teachers

log = logging.getLogger("loongsage")


def load_tokenizer(job: JobConfig) -> Any:
    """The policy tokenizer (``[model] tokenizer`` or the model directory), with a clear error."""
    from transformers import AutoTokenizer

    where = job.source_path or "<job>"
    source = job.model.tokenizer or job.model.path
    if not source:
        raise ConfigError(f"{where}: model: set 'tokenizer' or 'path' so prompts can be tokenized")
    path = Path(job.resolve_path(source))
    if not path.exists():
        key = "model.tokenizer" if job.model.tokenizer else "model.path"
        raise ConfigError(f"{where}: {key}: '{path}' does not exist")
    if job.model.path and not (Path(job.resolve_path(job.model.path)) / "config.json").is_file():
        raise ConfigError(f"{where}: model.path: no config.json in model directory "
                          f"'{job.resolve_path(job.model.path)}'")
    return AutoTokenizer.from_pretrained(str(path))


def remote_cause(exc: BaseException) -> str:
    """One line for an exception raised in a Ray actor (its cause, not Ray's wrapped traceback)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


class RunLifecycle(RunState):
    """Setup, resume, checkpoints and teardown (a part of :class:`.run.RLController`, whose
    ``__init__`` sets the state read here)."""

    def start(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.resolved.toml").write_text(dump_job_toml(self.job))
        write_secret_file(self.output_dir, self.secret)
        set_process_secret(self.secret)  # for clients built in this process (e.g. an engine load balancer)
        init_ray(self.job)
        # from here on Ctrl-C and SIGTERM end the run through close() (after Ray's own handlers)
        self.stop_signals = stop_on_signals()
        with_critic = self.advantage.spec.needs_critic
        if with_critic:
            Critic.check_resources(self.job)
        self.actors = create_actors(self.job, self.needs_reference, self.secret, with_critic=with_critic)
        if with_critic:  # in the bundles the run's placement group reserved for it
            self.critic = Critic.create(self.job, self.actors.placement_group, self.actors.critic_bundle or 0)
        if self.actors.teacher_bundle is not None:  # the teachers' actor, in its bundle likewise
            self.teachers = Teachers.create(self.job, self.host, self.actors.placement_group,
                                            self.actors.teacher_bundle)
        self.engine_router, generate_urls = start_engine_router(self.job, self.host, self.actors.engine_urls,
                                                                   secret=self.secret)
        # without a load balancer generation goes to the engines themselves, a group per request
        self.rollout = RolloutManager(self.job, self.host, self.tokenizer, self.actors.engine_urls,
                                      generate_urls if self.engine_router is not None else None,
                                      secret=self.secret)
        self.faults.attach(self.rollout)  # router turns whose engine died go to its replacement
        self.phases = PhaseSwitch(self.job, self.actors.trainers, self.rollout.clients, self.loop)
        if not self._maybe_resume() and self.job.train.lora is not None:
            # the engines load the (still no-op) adapter before the first generation names it:
            # SGLang serves a request's lora_path only once that adapter is loaded
            self._push_weights()
        self.phases.to_generation()  # a colocated trainer gives the devices to the engines first
        # per-step files keep only the steps before this run's first one (all of them for a fresh
        # run into an old directory; the redone ones after a resume)
        truncate_jsonl(self.output_dir / TRAINED_PROMPTS, self.step)
        self._start_loggers()
        self.records = recorder_for_run(self.job, self.output_dir, self.tokenizer, self.loggers, self.step)

    def _start_loggers(self) -> None:
        """The job's ``[[loggers]]``, each told to forget the steps a resumed run redoes."""
        for ref in component_refs(self.job, kinds=("logger",)):
            ctx = LoggerContext(where=ref.where, job=self.job, components=self.host,
                                output_dir=str(self.output_dir), total_steps=self.job.train.total_steps,
                                start_step=self.step)
            logger = self.host.bind(ref, ctx)
            if isinstance(logger, StepTruncation):
                logger.truncate_after(self.step)
            self.loggers.append(logger)

    def _maybe_resume(self) -> bool:
        if not self.job.run.resume:
            return False
        point, skipped = ckpt.find_resumable(self.output_dir)
        ckpt.warn_skipped(skipped, point.directory if point else None)
        if point is None:
            log.info("resume requested but no checkpoint in %s; starting fresh", self.output_dir)
            return False
        step, state = point.step, point.state
        self.resumed_state = state
        assert self.actors is not None
        try:
            gather([a.load_checkpoint.remote(str(ckpt.trainer_dir(self.output_dir, step)))
                    for a in self.actors.trainers])
            if self.critic is not None:
                self.critic.load(self.output_dir, step)
        except Exception as exc:  # the backend's own error (naming its file) is what the user needs
            raise ckpt.CheckpointError(f"cannot load checkpoint '{point.directory}': "
                                       f"{remote_cause(exc)}") from None
        self.mixer.load_state_dict(state["data"])
        self.step = step
        self.version = int(state["version"])
        self._push_weights()
        log.info("resumed from step %d", step)
        return True

    def save(self, step: int) -> None:
        assert self.actors is not None
        ckpt.prepare_step_dir(self.output_dir, step)
        gather([a.save_checkpoint.remote(str(ckpt.trainer_dir(self.output_dir, step)))
                 for a in self.actors.trainers])
        if self.critic is not None:
            self.critic.save(self.output_dir, step)
        if self.records is not None:
            self.records.flush()  # every step before the checkpoint has its records on disk
        ckpt.write_controller_state(self.output_dir, step, self.controller_state(step),
                                    keep=self.job.run.keep_checkpoints)

    def controller_state(self, step: int) -> dict[str, Any]:
        """What ``controller.json`` holds (written last, so it completes the checkpoint)."""
        return {"step": step, "version": self.version, "data": self.mixer.state_dict()}

    def _export_final(self) -> None:
        if self.job.run.save_hf_at_end and self.actors is not None:
            # every rank takes part (rank 0 writes, the others meet it at a barrier)
            gather([a.save_hf.remote(str(self.output_dir / "final_hf")) for a in self.actors.trainers])
            if self.job.train.lora is not None:  # the adapter alone too, as a PEFT directory
                gather([a.save_adapter.remote(str(self.output_dir / "final_adapter")) for a in self.actors.trainers])

    def close(self) -> None:
        restore_signals(self.stop_signals)  # a second signal now ends the process
        self.stop_signals = {}
        set_process_secret(None)  # the run's secret ends with the run (a later run in this process makes its own)
        if self.records is not None:
            self.records.close()  # before the loggers: it hands them trajectories
            self.records = None
        for lg in self.loggers:
            lg.close()
        if self.teachers is not None:  # before the actors: their shutdown removes the placement group
            self.teachers.close()
            self.teachers = None
        if self.rollout is not None:
            self.loop.run_until_complete(self.rollout.aclose())
        self.loop.close()
        if self.engine_router is not None:
            self.engine_router.shutdown()
            self.engine_router = None
        if self.critic is not None:  # before the actors: their shutdown removes the placement group
            self.critic.close()
            self.critic = None
        if self.actors is not None:
            self.actors.shutdown()
            self.actors = None
