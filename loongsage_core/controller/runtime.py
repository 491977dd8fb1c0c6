"""What one training run holds, and its life: :class:`Run`.

A :class:`Run` is composed of the run's parts, each a class of its own, and owns nothing else:

* placement and actors (:class:`.placement.Actors`: trainer ranks, engines), the critic
  (:class:`.critic.Critic`) and the teachers (:class:`.teacher_actor.Teachers`), the engine
  router in front of the engines, and the hand-over of shared devices (:class:`.colocation.PhaseSwitch`);
* the rollout (:class:`.rollout.RolloutManager`: engines, AgentFlow router, rewards) and the data
  (:class:`.data.DataMixer`), the step's algorithm (:class:`~loongsage_core.algorithms.StepAlgorithm`)
  and filters (:class:`.filters.GroupFilters`), the learning half of a step (:class:`.learner.Learner`);
* checkpoints, loggers and rollout records, step health (:class:`.health.StepHealth`) and the
  fault supervisor (:class:`.faults.FaultSupervisor`), which reaches the run only through this
  class's public methods.

The loops that drive a run (:class:`.run.SyncLoop`, :class:`.async_loop.AsyncLoop`) use it through
the same public methods: :meth:`start`, :meth:`push_weights`, :meth:`log`, :meth:`save`,
:meth:`record`, :meth:`export_final` and :meth:`close`.

Outputs in the run directory: ``metrics.jsonl`` (one object per step), ``checkpoints/``,
``config.resolved.toml``, ``run_secret`` (the run secret, mode 0600: engines and the router's admin
API require it), ``trained_prompts.jsonl`` and, at the end, ``final_hf/`` (a Hugging Face directory).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

from loongsage_hookspecs import Batch, LoggerContext, StepTruncation, TrajectoryGroup

from ..algorithms import StepAlgorithm
from ..algorithms.distill import distill_setup, uses_reference_model
from ..config import component_refs, dump_job_toml
from ..hf_models import load_tokenizer
from ..records.writer import RolloutRecorder, recorder_for_run
from ..resolve import ResolvedJob
from ..run_files import checkpoint as ckpt
from ..run_files.run_dir import truncate_jsonl
from ..security import new_secret, set_process_secret, write_secret_file
from .colocation import PhaseSwitch
from .critic import Critic
from .data import DataMixer
from .evaluation import Evaluator
from .faults import FaultSupervisor
from .filters import GroupFilters
from .health import StepHealth
from .learner import Learner
from .placement import Actors, create_actors, init_ray, start_engine_router
from .remote import gather
from .rollout import RolloutManager
from .signals import restore_signals, stop_on_signals
from .teacher_actor import Teachers
from .worker_group import mean_metrics

log = logging.getLogger("loongsage")

TRAINED_PROMPTS = "trained_prompts.jsonl"


def remote_cause(exc: BaseException) -> str:
    """One line for an exception raised in a Ray actor (its cause, not Ray's wrapped traceback)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def final_evaluation(run: "Run", metrics: dict[str, float]) -> dict[str, float]:
    """The evaluation after the last step, logged (and recorded) as a step of its own."""
    metrics["step"] = run.step
    run.log(run.step, metrics)
    run.record(run.step, [], None)
    return metrics


class Run:
    """One run's parts and progress (``step``: the next step to run; ``version``: the weight
    version the engines serve). Built from a resolved job; :meth:`start` brings the actors up."""

    def __init__(self, resolved: ResolvedJob, output_dir: Path) -> None:
        self.job = resolved.job
        self.host = resolved.host
        self.output_dir = output_dir
        self.tokenizer = load_tokenizer(self.job)
        self.mixer = DataMixer(self.job, self.host)
        self.needs_reference = uses_reference_model(self.job, self.host)
        # the step's algorithm, in one place (docs/guide/algorithms.md), and the group filters of both loops
        self.algorithm = StepAlgorithm.from_job(self.job, self.host, distill=distill_setup(self.job, self.host))
        self.filters = GroupFilters.from_job(self.job, self.host)
        self.health = StepHealth(self.job.train.max_bad_steps)  # bad steps: skipped, counted, bounded
        self.faults = FaultSupervisor(self)  # dead engines replaced, dead trainers explained
        self.learner = Learner(self)
        # the held-out evaluation ([eval]); its last groups wait for the step's rollout records
        self.evaluator = Evaluator(self.job, self.host) if self.job.eval.enabled else None
        self.evaluated: list[TrajectoryGroup] = []
        self.step = 0
        self.version = 0
        self.actors: Actors | None = None
        self.engine_router: Any = None  # a load balancer in front of the engines ([rollout] engine_router)
        self.phases: PhaseSwitch | None = None
        self.rollout: RolloutManager | None = None
        self.critic: Critic | None = None  # the value model, when the advantage needs_critic
        self.teachers: Teachers | None = None  # the teacher actor, started with the other actors
        self.loggers: list[Any] = []
        self.records: RolloutRecorder | None = None  # rollout records writer (loongsage_core/records)
        self.resumed_state: dict[str, Any] | None = None  # controller.json of the checkpoint resumed from
        # one event loop for the whole run: the engine clients' connections belong to it
        self.loop = asyncio.new_event_loop()
        self.secret = new_secret()  # the run secret: engines and the router's control endpoints need it
        self.stop_signals: dict[int, Any] = {}  # the SIGINT / SIGTERM handlers start() replaced

    @property
    def needs_critic(self) -> bool:
        """Whether the advantage estimator trains a value model (its spec's ``needs_critic``)."""
        return bool(self.algorithm.advantage.spec.needs_critic)

    # ------------------------------------------------------------------ start and resume

    def start(self) -> None:
        """The run directory's files, the Ray cluster, the model actors, the critic and the
        teachers in one placement group, the engine router, the rollout manager, resume, the loggers."""
        self.start_actors()
        if not self.resume() and self.job.train.lora is not None:
            # the engines load the (still no-op) adapter before the first generation names it:
            # SGLang serves a request's lora_path only once that adapter is loaded
            self.push_weights()
        assert self.phases is not None
        self.phases.to_generation()  # a colocated trainer gives the devices to the engines first
        self.start_outputs()

    def start_actors(self) -> None:
        """Everything that holds a model or serves one: the Ray cluster, the model actors, the
        critic and the teachers in one placement group, the engine router and the rollout manager
        (with the secret and resolved job written into the output directory)."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.resolved.toml").write_text(dump_job_toml(self.job))
        write_secret_file(self.output_dir, self.secret)
        set_process_secret(self.secret)  # for clients built in this process (e.g. an engine load balancer)
        init_ray(self.job)
        # from here on Ctrl-C and SIGTERM end the run through close() (after Ray's own handlers)
        self.stop_signals = stop_on_signals()
        if self.needs_critic:
            Critic.check_resources(self.job)
        self.actors = create_actors(self.job, self.needs_reference, self.secret, with_critic=self.needs_critic)
        if self.needs_critic:  # in the bundles the run's placement group reserved for it
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
        if self.evaluator is not None:
            self.evaluator.register(self.rollout)
        self.phases = PhaseSwitch(self.job, self.actors.trainers, self.rollout.clients, self.loop)

    def start_outputs(self) -> None:
        """The per-step outputs: files cut back to the steps before this run's first one (all of
        them for a fresh run into an old directory; the redone ones after a resume), the job's
        ``[[loggers]]`` (each told to forget the redone steps) and the rollout records."""
        truncate_jsonl(self.output_dir / TRAINED_PROMPTS, self.step)
        for ref in component_refs(self.job, kinds=("logger",)):
            ctx = LoggerContext(where=ref.where, job=self.job, components=self.host,
                                output_dir=str(self.output_dir), total_steps=self.job.train.total_steps,
                                start_step=self.step)
            logger = self.host.bind(ref, ctx)
            if isinstance(logger, StepTruncation):
                logger.truncate_after(self.step)
            self.loggers.append(logger)
        self.records = recorder_for_run(self.job, self.output_dir, self.tokenizer, self.loggers, self.step)

    def resume(self) -> bool:
        """With ``run.resume``, continue from the newest intact checkpoint: trainer and critic
        state, the data cursor, the step and the weight version (pushed to the engines). The
        checkpoint's ``controller.json`` stays in :attr:`resumed_state` for the loop's own state."""
        if not self.job.run.resume:
            return False
        point, skipped = ckpt.find_resumable(self.output_dir)
        ckpt.warn_skipped(skipped, point.directory if point else None)
        if point is None:
            log.info("resume requested but no checkpoint in %s; starting fresh", self.output_dir)
            return False
        self.load_checkpoint(point)
        self.resumed_state = state = point.state
        self.mixer.load_state_dict(state["data"])
        self.step = point.step
        log.info("resumed from step %d", point.step)
        return True

    def load_checkpoint(self, point: ckpt.ResumePoint) -> None:
        """Load an intact checkpoint (of any run directory: its ``checkpoints/step_N``) into the
        trainer ranks and the critic, take its weight version and push the weights to the engines."""
        assert self.actors is not None
        run_dir = point.directory.parent.parent
        try:
            gather([a.load_checkpoint.remote(str(ckpt.trainer_dir(run_dir, point.step)))
                    for a in self.actors.trainers])
            if self.critic is not None:
                self.critic.load(run_dir, point.step)
        except Exception as exc:  # the backend's own error (naming its file) is what the user needs
            raise ckpt.CheckpointError(f"cannot load checkpoint '{point.directory}': {remote_cause(exc)}") from None
        self.version = int(point.state["version"])
        self.push_weights()

    # ------------------------------------------------------------------ during the run

    def push_weights(self, version: int | None = None) -> dict[str, float]:
        """Move the trainer's weights into every engine, tagged ``version`` (default: current)."""
        assert self.actors is not None
        version = self.version if version is None else version
        # every rank joins (reading the weights is a collective under model parallelism); colocated,
        # rank i feeds its own engine i; otherwise rank 0 feeds every engine
        n_engines = len(self.actors.engine_actors)
        if self.actors.colocated:
            targets: list[Any] = [None if i < n_engines else [] for i in range(len(self.actors.trainers))]
        else:
            targets = [list(self.actors.engine_urls) if i == 0 else [] for i in range(len(self.actors.trainers))]
        stats = [s for s in gather([a.push_weights.remote(version, t)
                                    for a, t in zip(self.actors.trainers, targets)]) if s]
        # a transport's own perf/weight_sync_* (bytes moved, delta ratio) keep their names
        return {k if k.startswith("perf/weight_sync_") else f"perf/weight_sync_{k}": v
                for k, v in mean_metrics(stats).items()}

    def evaluation_due(self, step: int) -> bool:
        """Whether the job's ``[eval]`` runs before ``step`` (``train.total_steps``: after the last)."""
        return self.evaluator is not None and self.evaluator.due(step, self.job.train.total_steps)

    async def evaluate_async(self, step: int) -> dict[str, float]:
        """The held-out evaluation of the weights the engines serve, before ``step``: its ``eval/*``
        metrics; its groups go into the step's rollout records (:meth:`record`)."""
        assert self.evaluator is not None and self.rollout is not None
        metrics, self.evaluated = await self.evaluator.evaluate(self.rollout, step)
        return metrics

    def evaluate(self, step: int) -> dict[str, float]:
        """:meth:`evaluate_async` from outside the run's event loop."""
        return self.loop.run_until_complete(self.evaluate_async(step))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Hand a step's metrics to every logger."""
        for logger in self.loggers:
            logger.log(step, metrics)

    def record(self, step: int, groups: Sequence[TrajectoryGroup], batch: Batch | None,
               sampled: Sequence[TrajectoryGroup] = ()) -> None:
        """Hand the step's trajectories and the batch that trained them to the records writer
        (right after learning, before the weight version moves on); ``sampled``: every group the
        step generated, the filtered-out ones too; the evaluation run before the step goes with them."""
        evaluated, self.evaluated = self.evaluated, []
        if self.records is not None:
            self.records.add(step, groups, batch, policy_version=self.version, filtered=sampled, evaluated=evaluated)

    def record_trained(self, step: int, groups: Sequence[TrajectoryGroup]) -> None:
        """Append the prompt ids trained at ``step`` to ``trained_prompts.jsonl`` (an audit trail:
        with resume, every prompt of an epoch appears exactly once)."""
        entry: dict[str, Any] = {"step": step, "prompt_ids": [g.prompt_id for g in groups]}
        if self.health.last_problem is not None:
            entry["skipped"] = self.health.last_problem  # drawn, but the step was not applied
        with (self.output_dir / TRAINED_PROMPTS).open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry) + "\n")

    # ------------------------------------------------------------------ checkpoints and the end

    def save(self, step: int, extra: Mapping[str, Any] | None = None) -> None:
        """A checkpoint of ``step``: trainer ranks, critic ranks, then ``controller.json`` (the
        step, the weight version, the data cursor and the loop's ``extra`` state), which
        completes it."""
        assert self.actors is not None
        ckpt.prepare_step_dir(self.output_dir, step)
        gather([a.save_checkpoint.remote(str(ckpt.trainer_dir(self.output_dir, step)))
                for a in self.actors.trainers])
        if self.critic is not None:
            self.critic.save(self.output_dir, step)
        if self.records is not None:
            self.records.flush()  # every step before the checkpoint has its records on disk
        state = {"step": step, "version": self.version, "data": self.mixer.state_dict(), **(extra or {})}
        ckpt.write_controller_state(self.output_dir, step, state, keep=self.job.run.keep_checkpoints)

    def export_final(self) -> None:
        """``final_hf/`` (and ``final_adapter/`` in a LoRA run), unless ``run.save_hf_at_end = false``."""
        if self.job.run.save_hf_at_end and self.actors is not None:
            # every rank takes part (rank 0 writes, the others meet it at a barrier)
            gather([a.save_hf.remote(str(self.output_dir / "final_hf")) for a in self.actors.trainers])
            if self.job.train.lora is not None:  # the adapter alone too, as a PEFT directory
                gather([a.save_adapter.remote(str(self.output_dir / "final_adapter")) for a in self.actors.trainers])

    def close(self) -> None:
        """Everything :meth:`start` started, in reverse."""
        restore_signals(self.stop_signals)  # a second signal now ends the process
        self.stop_signals = {}
        set_process_secret(None)  # the run's secret ends with the run (a later run in this process makes its own)
        if self.records is not None:
            self.records.close()  # before the loggers: it hands them trajectories
            self.records = None
        for logger in self.loggers:
            logger.close()
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
