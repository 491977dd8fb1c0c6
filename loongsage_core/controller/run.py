"""``loongsage run``: the synchronous RL loop of DESIGN.md section 4 on a Ray cluster.

One step::

    prompts -> engines generate (tokens, log-probs, weight version) -> rewards -> filters
            -> rows -> old log-probs (recomputed) [-> reference log-probs] [-> teachers] [-> values]
            -> StepAlgorithm.prepare (corrections, token rewards, advantages, the k3 gap)
            -> mini-batches with their norms (policy loss per micro-batch inside the train backend)
            -> weights to engines (version += 1) -> metrics -> checkpoint

The algorithm of the step is :class:`loongsage_core.algorithms.StepAlgorithm`; this module only
moves rows between the actors. Actor calls go through :func:`.remote.gather` (Ray handles in a
run, :class:`.remote.LocalActor` in-process in the controller tests).

Outputs in the run directory: ``metrics.jsonl`` (one object per step), ``checkpoints/``,
``config.resolved.toml``, ``run_secret`` (the run secret, mode 0600: engines and the router's admin
API require it) and, at the end, ``final_hf/`` (a Hugging Face directory).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import torch

from loongsage_hookspecs import Batch, TrajectoryGroup

from ..algorithms import StepAlgorithm
from ..config import ConfigError, JobConfig, dump_job_toml
from ..records.writer import RolloutRecorder, recorder_for_run
from ..resolve import ResolvedJob
from ..security import new_secret, set_process_secret, write_secret_file
from . import checkpoint as ckpt
from .batching import build_batch
from .colocation import PhaseSwitch
from .critic import Critic
from .data import DataMixer, interleave_by_source
from .faults import FaultSupervisor
from .health import StepHealth
from .metrics import rollout_metrics
from .placement import Actors, create_actors, init_ray, start_engine_router
from .remote import gather
from .rollout import RolloutManager
from .run_dir import truncate_jsonl
from .teachers import TeacherGroup, apply_teachers, distill_setup, uses_reference_model

log = logging.getLogger("loongsage")

TRAINED_PROMPTS = "trained_prompts.jsonl"


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




def mean_metrics(items: Sequence[dict[str, float]]) -> dict[str, float]:
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for m in items:
        for k, v in m.items():
            sums[k] += float(v)
            counts[k] += 1
    return {k: sums[k] / counts[k] for k in sums}


class RLController:
    """Owns the actors, the data and the loop of one run."""

    def __init__(self, resolved: ResolvedJob, output_dir: Path) -> None:
        self.job = resolved.job
        self.host = resolved.host
        self.output_dir = output_dir
        self.tokenizer = load_tokenizer(self.job)
        self.mixer = DataMixer(self.job, self.host)
        alg = self.job.algorithm
        self.needs_reference = uses_reference_model(self.job, self.host)
        self.teachers = TeacherGroup.from_job(self.job, self.host)
        # the step's algorithm, in one place (DESIGN.md section 6)
        self.algorithm = StepAlgorithm(self.job, self.host, distill=distill_setup(self.job, self.host))
        self.advantage = self.algorithm.advantage
        self.filters = [self.host.get("filter", n) for n in alg.filters]
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

    # ------------------------------------------------------------------ setup

    def start(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.resolved.toml").write_text(dump_job_toml(self.job))
        write_secret_file(self.output_dir, self.secret)
        set_process_secret(self.secret)  # for clients built in this process (e.g. an engine load balancer)
        init_ray(self.job)
        self.actors = create_actors(self.job, self.needs_reference, self.secret)
        if self.advantage.needs_critic:
            self.critic = Critic.create(self.job)
        self.engine_router, generate_urls = start_engine_router(self.job, self.host, self.actors.engine_urls)
        self.rollout = RolloutManager(self.job, self.host, self.tokenizer, self.actors.engine_urls, generate_urls,
                                      secret=self.secret)
        self.phases = PhaseSwitch(self.job, self.actors.trainers, self.rollout.clients, self.loop)
        self._maybe_resume()
        self.phases.to_generation()  # a colocated trainer gives the devices to the engines first
        # per-step files keep only the steps before this run's first one (all of them for a fresh
        # run into an old directory; the redone ones after a resume)
        truncate_jsonl(self.output_dir / TRAINED_PROMPTS, self.step)
        for lg in self.job.loggers:
            spec = self.host.get("logger", lg.name)
            args = {"total_steps": self.job.train.total_steps, **lg.args} if lg.name == "console" else dict(lg.args)
            logger = spec.factory(str(self.output_dir), **args)
            if hasattr(logger, "truncate_after"):
                logger.truncate_after(self.step)
            self.loggers.append(logger)
        self.records = recorder_for_run(self.job, self.output_dir, self.tokenizer, self.loggers, self.step)

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

    # ------------------------------------------------------------------ one step

    def collect(self, step: int) -> tuple[list[TrajectoryGroup], dict[str, float]]:
        """Generate, score and filter this step's groups (refilling dropped ones when allowed)."""
        assert self.rollout is not None
        want = self.job.rollout.prompts_per_step
        kept: list[TrajectoryGroup] = []
        sampled: list[TrajectoryGroup] = []
        dropped = 0
        attempts = 0
        offset = 0
        while len(kept) < want:
            prompts = self.mixer.next_prompts(want - len(kept))
            groups = self.loop.run_until_complete(self.faults.generate(prompts, step, offset=offset))
            offset += len(prompts)
            sampled.extend(groups)
            for f, name in zip(self.filters, self.job.algorithm.filters):
                before = len(groups)
                groups = list(f.fn(groups, **self.job.algorithm.filter_args.get(name, {})))
                dropped += before - len(groups)
            kept.extend(groups)
            attempts += 1
            if attempts > self.job.algorithm.max_filter_retries:
                break
        self.sampled_groups = sampled  # the rollout records keep the filtered-out groups too
        metrics = rollout_metrics(sampled)
        metrics["rollout/filter_drop"] = float(dropped)
        metrics["rollout/filter_attempts"] = float(attempts)
        metrics["rollout/groups_trained"] = float(len(kept))
        return kept, metrics

    def _forward(self, batch: Batch, reference: bool = False) -> torch.Tensor:
        assert self.actors is not None
        shards = self.actors.rows_per_trainer(len(batch))
        calls, replica_of = [], []
        # every rank is called, an empty share included: ranks of an expert-parallel group (and of
        # data-parallel backends with collectives in forward) must run together
        for actor, rows, replica in zip(self.actors.trainers, shards, self.actors.dp_ranks):
            calls.append((actor.reference_forward if reference else actor.forward).remote(batch.select(rows)))
            replica_of.append(replica)
        # every rank of a model replica returns the same rows: keep one answer per replica, in order
        first: dict[int, Any] = {}
        for replica, out in zip(replica_of, gather(calls)):
            first.setdefault(replica, out)
        outs = [first[r] for r in sorted(first)]
        width = batch["input_ids"].shape[1]
        parts = [torch.nn.functional.pad(o["logprobs"], (0, width - o["logprobs"].shape[1])) for o in outs]
        return torch.cat(parts, 0).float()

    def mini_batch_order(self, batch: Batch, step: int) -> list[int]:
        """The step's rows in mini-batch order: interleaved so every mini-batch and every rank
        carries each source's share (the policy and the critic train on the same mini-batches)."""
        assert self.actors is not None
        return interleave_by_source(batch.meta["source"], self.job.train.mini_batch_size, self.actors.dp_size,
                                    seed=f"{self.job.run.seed}:{step}:minibatch")

    def train(self, batch: Batch, step: int) -> dict[str, float]:
        assert self.actors is not None
        order = self.mini_batch_order(batch, step)
        results: list[dict[str, float]] = []
        for _epoch in range(self.job.train.ppo_epochs):
            for mini, norm in self.algorithm.mini_batches(batch, order, self.job.train.mini_batch_size):
                shards = self.actors.rows_per_trainer(len(mini))
                calls = [a.train_mini_batch.remote(mini.select(rows), norm)
                         for a, rows in zip(self.actors.trainers, shards)]
                results.append(mean_metrics(gather(calls)))
        out = mean_metrics(results)
        out["train/num_mini_batches"] = float(len(results))
        return out

    def _push_weights(self, version: int | None = None) -> dict[str, float]:
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
        return {f"perf/weight_sync_{k}": v for k, v in mean_metrics(stats).items()}

    def learn(self, groups: Sequence[TrajectoryGroup], step: int) -> tuple[dict[str, float], float]:
        """Train on ``groups`` (rows, old/reference log-probs, advantages, mini-batches).

        Returns the ``train/*`` metrics and the number of trained tokens; the caller moves the
        new weights to the engines (the sync and async loops do that differently).
        """
        assert self.actors is not None
        t0 = time.perf_counter()
        batch = build_batch(groups, pad_id=self.tokenizer.pad_token_id or 0,
                            mask_stale=self.job.rollout.partial and self.job.rollout.partial_mask_stale)
        self.last_batch = batch
        metrics: dict[str, float] = {"rollout/num_rows": float(len(batch))}
        if not len(batch):
            return metrics, 0.0
        alg = self.job.algorithm
        if alg.recompute_old_logprobs:
            batch.tensors["old_logprobs"] = self._forward(batch) * batch["loss_mask"]
        else:
            batch.tensors["old_logprobs"] = batch["rollout_logprobs"].clone()
        if self.needs_reference:
            batch.tensors["ref_logprobs"] = self._forward(batch, reference=True) * batch["loss_mask"]
        metrics["timing/old_logprobs"] = time.perf_counter() - t0
        if self.critic is not None:
            batch.tensors["values"] = self.critic.values(batch)
        metrics.update(apply_teachers(batch, self.job, self.host, self.teachers))
        # corrections, token rewards, advantages and returns, the train-inference gap: once, here
        metrics.update(self.algorithm.prepare(batch))
        metrics.update(self.train(batch, step))
        if self.critic is not None:
            metrics.update(self.critic.train(batch, step, self.algorithm, self.mini_batch_order(batch, step)))
        every = alg.ref_update_every
        if self.needs_reference and every > 0 and (step + 1) % every == 0:
            gather([a.refresh_reference.remote() for a in self.actors.trainers])
        return metrics, float(batch["loss_mask"].sum())

    def run_step(self, step: int) -> dict[str, float]:
        """One synchronous step: collect, learn, then move the weights to the idle engines."""
        t0 = time.perf_counter()
        assert self.phases is not None
        groups, metrics = self.collect(step)
        t_rollout = time.perf_counter()
        metrics.update(self.phases.to_training())
        train_metrics, tokens = self.learn(groups, step)
        self.record_rollouts(step, groups)
        metrics.update(train_metrics)
        metrics.update(self.health.observe(step, metrics, groups))  # raises after train.max_bad_steps
        t_train = time.perf_counter()
        if tokens and self.health.last_problem is None:
            self.version += 1
            metrics.update(self.phases.to_weight_sync())
            metrics.update(self.faults.push_weights(self._push_weights))  # replaces an engine that died
        metrics.update(self.phases.to_generation())
        t_update = time.perf_counter()
        self.record_trained(step, groups)
        metrics.update({
            "timing/rollout": t_rollout - t0,
            "timing/train": t_train - t_rollout,
            "timing/update_weights": t_update - t_train,
            "timing/step": time.perf_counter() - t0,
            "perf/generated_tokens": tokens,
            "perf/weight_version": float(self.version),
            "perf/tokens_per_s": tokens / max(t_rollout - t0, 1e-9),
            "fault/engine_restarts": float(self.faults.engine_restarts),
        })
        return metrics

    def record_rollouts(self, step: int, groups: Sequence[TrajectoryGroup]) -> None:
        """Hand the step's trajectories and the batch that trained them to the records writer
        (call right after :meth:`learn`, before the weight version moves on)."""
        if self.records is not None:
            sampled, self.sampled_groups = self.sampled_groups, []
            self.records.add(step, groups, self.last_batch, policy_version=self.version, filtered=sampled)

    def record_trained(self, step: int, groups: Sequence[TrajectoryGroup]) -> None:
        """Append the prompt ids trained at ``step`` to ``trained_prompts.jsonl`` (an audit trail:
        with resume, every prompt of an epoch appears exactly once)."""
        entry: dict[str, Any] = {"step": step, "prompt_ids": [g.prompt_id for g in groups]}
        if self.health.last_problem is not None:
            entry["skipped"] = self.health.last_problem  # drawn, but the step was not applied
        line = json.dumps(entry)
        with (self.output_dir / TRAINED_PROMPTS).open("a", encoding="utf-8") as fh:
            fh.write(line + "\n")

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

    def _export_final(self) -> None:
        if self.job.run.save_hf_at_end and self.actors is not None:
            # every rank takes part (rank 0 writes, the others meet it at a barrier)
            gather([a.save_hf.remote(str(self.output_dir / "final_hf")) for a in self.actors.trainers])

    def close(self) -> None:
        set_process_secret(None)  # the run's secret ends with the run (a later run in this process makes its own)
        if self.records is not None:
            self.records.close()  # before the loggers: it hands them trajectories
            self.records = None
        for lg in self.loggers:
            lg.close()
        if self.teachers is not None:
            self.teachers.close()
        if self.rollout is not None:
            self.loop.run_until_complete(self.rollout.aclose())
        self.loop.close()
        if self.engine_router is not None:
            self.engine_router.shutdown()
            self.engine_router = None
        if self.critic is not None:
            self.critic.close()
            self.critic = None
        if self.actors is not None:
            self.actors.shutdown()
            self.actors = None


def remote_cause(exc: BaseException) -> str:
    """One line for an exception raised in a Ray actor (its cause, not Ray's wrapped traceback)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
