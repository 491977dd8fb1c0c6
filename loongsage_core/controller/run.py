"""``loongsage run``: the synchronous RL loop of DESIGN.md section 4 on a Ray cluster.

The controller is three parts, each a module of its own:

* :class:`.step.StepRunner`: one step (collect, learn, weights to the engines), calling the
  step's algorithm (:class:`loongsage_core.algorithms.StepAlgorithm`) and reaching the actors
  through :class:`.worker_group.WorkerGroup` (one sharding rule for policy, reference and critic;
  the step's rows shipped once per stage);
* :class:`.lifecycle.RunLifecycle`: start (actors and critic in one placement group, engine
  router, loggers), resume, checkpoints, close;
* :class:`RLController` (here): the run's state and the loop over the steps (:meth:`fit`).

Actor calls go through :func:`.remote.gather` (Ray handles in a run, :class:`.remote.LocalActor`
in-process in the controller tests). :mod:`.async_run` overlaps rollout and training instead.

Outputs in the run directory: ``metrics.jsonl`` (one object per step), ``checkpoints/``,
``config.resolved.toml``, ``run_secret`` (the run secret, mode 0600: engines and the router's admin
API require it) and, at the end, ``final_hf/`` (a Hugging Face directory).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from loongsage_hookspecs import Batch, TrajectoryGroup

from ..algorithms import StepAlgorithm
from ..records.writer import RolloutRecorder
from ..resolve import ResolvedJob
from ..security import new_secret
from .colocation import PhaseSwitch
from .critic import Critic
from .data import DataMixer
from .faults import FaultSupervisor
from .filters import GroupFilters
from .health import StepHealth
from .lifecycle import RunLifecycle, load_tokenizer, remote_cause
from .placement import Actors
from .rollout import RolloutManager
from .run_dir import truncate_jsonl
from .step import TRAINED_PROMPTS, StepRunner
from .teacher_actor import Teachers
from .teachers import distill_setup, uses_reference_model
from .worker_group import mean_metrics

__all__ = ["RLController", "TRAINED_PROMPTS", "load_tokenizer", "mean_metrics", "remote_cause", "truncate_jsonl"]


class RLController(RunLifecycle, StepRunner):
    """Owns the actors, the data and the loop of one run."""

    def __init__(self, resolved: ResolvedJob, output_dir: Path) -> None:
        self.job = resolved.job
        self.host = resolved.host
        self.output_dir = output_dir
        self.tokenizer = load_tokenizer(self.job)
        self.mixer = DataMixer(self.job, self.host)
        self.needs_reference = uses_reference_model(self.job, self.host)
        self.teachers: Teachers | None = None  # the teacher actor, started with the other actors
        # the step's algorithm, in one place (DESIGN.md section 6)
        self.algorithm = StepAlgorithm.from_job(self.job, self.host, distill=distill_setup(self.job, self.host))
        self.advantage = self.algorithm.advantage
        self.filters = GroupFilters.from_job(self.job, self.host)
        self.loggers: list[Any] = []
        self.step = 0
        self.version = 0
        self.actors: Actors | None = None
        self.engine_router: Any = None  # a load balancer in front of the engines ([rollout] engine_router)
        self.phases: PhaseSwitch | None = None
        self.rollout: RolloutManager | None = None
        self.critic: Critic | None = None  # the value model, when the advantage needs_critic (controller/critic.py)
        self.resumed_state: dict[str, Any] | None = None  # controller.json of the checkpoint resumed from
        self.health = StepHealth(self.job.train.max_bad_steps)  # bad steps: skipped, counted, bounded
        self.faults = FaultSupervisor(self)  # dead engines replaced, dead trainers explained
        self.records: RolloutRecorder | None = None  # rollout records writer (loongsage_core/records)
        self.last_batch: Batch | None = None  # the batch of the last learn() (for the rollout records)
        self.sampled_groups: list[TrajectoryGroup] = []  # every group the last collect() sampled
        # one event loop for the whole run: the engine clients' connections belong to it
        self.loop = asyncio.new_event_loop()
        self.secret = new_secret()  # the run secret: engines and the router's control endpoints need it
        self.stop_signals: dict[int, Any] = {}  # the SIGINT / SIGTERM handlers start() replaced

    # ------------------------------------------------------------------ the loop

    def fit(self) -> list[dict[str, float]]:
        """Run from the current step to ``train.total_steps``; returns every step's metrics."""
        history = []
        every = self.job.run.checkpoint_every
        while self.step < self.job.train.total_steps:
            step = self.step
            metrics = self.run_step(step)
            metrics["step"] = step
            history.append(metrics)
            for lg in self.loggers:
                lg.log(step, metrics)
            self.step = step + 1
            if every > 0 and self.step % every == 0:
                self.save(self.step)
        self._export_final()
        return history
