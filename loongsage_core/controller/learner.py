"""The learning half of a step: :class:`Learner`.

Given a step's kept groups, a learner builds the rows and trains on them::

    groups -> rows, shipped to the actors once (WorkerGroup.share)
           -> old log-probs (recomputed, unless the training forward's own serve:
              algorithms/old_logprobs.py) [-> reference log-probs] [-> teachers] [-> values]
           -> StepAlgorithm.prepare (corrections, token rewards, advantages, the k3 gap)
           -> the prepared rows, shipped once -> policy epochs [-> critic epochs]

and reports the phases' model FLOP utilisation (``perf/mfu_*``). Moving the new weights to the
engines is the loop's (the synchronous and asynchronous loops do it differently). The learner
reads the run's parts (:class:`.runtime.Run`: actors, critic, teachers, algorithm, version).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from loongsage_hookspecs import Batch, TrajectoryGroup

from ..algorithms.old_logprobs import (
    compares_router_replay,
    mark_old_from_training_forward,
    old_from_training_forward,
    old_logprob_pass,
)
from ..algorithms.step import ROUTER_REPLAY_OUTPUTS, router_replay_metrics
from ..config import JobConfig
from ..flops import ModelShape, generation_flops, mfu, scoring_flops
from .batching import build_batch, credit_options
from .mixing import interleave_by_source
from .remote import gather, own_time
from .worker_group import WorkerGroup

if TYPE_CHECKING:  # pragma: no cover
    from ..algorithms import StepAlgorithm
    from ..plugins import PluginHost
    from .critic import Critic
    from .placement import Actors
    from .teacher_actor import Teachers

CONTROLLER_OVERHEAD = "timing/controller_overhead"
"""The controller's own work in a step (seconds): building and padding the batch, advantages,
shipping rows, bookkeeping; the rollout and the time spent waiting on actors and engines excluded."""


class LearningRun(Protocol):
    """What a learner reads of its run (:class:`.runtime.Run` is one): the job, the actors and
    parts that train, and the weight version the engines serve."""

    job: JobConfig
    host: "PluginHost"
    actors: "Actors | None"
    algorithm: "StepAlgorithm"
    tokenizer: Any
    needs_reference: bool
    critic: "Critic | None"
    teachers: "Teachers | None"
    version: int


class Learner:
    """Trains the run's policy (and critic) on a step's groups; ``last_batch`` is the batch of the
    last :meth:`learn` (the rollout records keep it)."""

    def __init__(self, run: LearningRun) -> None:
        self.run = run
        self.job = run.job
        self.last_batch: Batch | None = None
        self._flops_setup: tuple[ModelShape | None, float, int, int, bool] | None = None

    @property
    def policy(self) -> WorkerGroup:
        """The trainer ranks (each holding the policy and, when needed, the reference model)."""
        assert self.run.actors is not None
        return WorkerGroup(self.run.actors.trainers, self.run.actors.dp_ranks, self.run.actors.dp_size,
                           balance_tokens=bool(self.job.train.max_tokens_per_micro_batch))

    def mini_batch_order(self, batch: Batch, step: int) -> list[int]:
        """The step's rows in mini-batch order: interleaved so every mini-batch and every rank
        carries each source's share (the policy and the critic train on the same mini-batches)."""
        assert self.run.actors is not None
        return interleave_by_source(batch.meta["source"], self.job.train.mini_batch_size, self.run.actors.dp_size,
                                    seed=f"{self.job.run.seed}:{step}:minibatch")

    def train(self, batch: Batch, step: int) -> dict[str, float]:
        """Ship the prepared rows (advantages, returns) once, then ``[train] ppo_epochs`` passes
        over the policy's mini-batches and, with a critic, the critic's epochs on the same rows."""
        policy = self.policy
        shared = policy.share(batch)
        order = self.mini_batch_order(batch, step)
        size = self.job.train.mini_batch_size
        mini_batches = [mb for _ in range(self.job.train.ppo_epochs)
                        for mb in self.run.algorithm.mini_batch_rows(batch, order, size)]
        t0 = time.perf_counter()
        out, count = policy.train(shared, mini_batches, batch)
        out["timing/policy_train"] = time.perf_counter() - t0
        out["train/num_mini_batches"] = float(count)
        if old_from_training_forward(batch) and count == 1:  # keep them for the records
            old = policy.training_forward_logprobs(batch, mini_batches[0][0])
            if old is not None:
                batch.tensors["old_logprobs"] = old * batch["loss_mask"]
        if self.run.critic is not None:
            out.update(self.run.critic.train(batch, step, self.run.algorithm, order, shared))
        return out

    def learn(self, groups: Sequence[TrajectoryGroup], step: int) -> tuple[dict[str, float], float]:
        """Train on ``groups`` (rows, old/reference log-probs, advantages, mini-batches).

        Returns the ``train/*`` metrics and the number of trained tokens; the caller moves the
        new weights to the engines (the sync and async loops do that differently). The metrics
        carry ``timing/controller_overhead``: the seconds of this thread's own work in it (what
        was not spent waiting on the actors).
        """
        own: dict[str, float] = {}
        with own_time(own, CONTROLLER_OVERHEAD):
            metrics, tokens = self._learn(groups, step)
        metrics.update(own)
        return metrics, tokens

    def _learn(self, groups: Sequence[TrajectoryGroup], step: int) -> tuple[dict[str, float], float]:
        assert self.run.actors is not None
        t0 = time.perf_counter()
        batch = build_batch(groups, pad_id=self.run.tokenizer.pad_token_id or 0,
                            mask_stale=self.job.rollout.partial and self.job.rollout.partial_mask_stale,
                            **credit_options(self.job, self.run.host))  # which failures count, and how small a group
        self.last_batch = batch
        metrics: dict[str, float] = {"rollout/num_rows": float(len(batch))}
        if not len(batch):
            return metrics, 0.0
        alg = self.job.algorithm
        policy = self.policy
        run_pass, _ = old_logprob_pass(self.job, batch, needed_before_training=(
            self.run.algorithm.needs_old_logprobs_before_training or self.run.teachers is not None))
        metrics["perf/old_logprob_pass_skipped"] = float(alg.recompute_old_logprobs and not run_pass)
        needs_forward = run_pass or self.run.needs_reference or self.run.critic is not None
        rows = policy.share(batch) if needs_forward else None  # the rollout rows, shipped once
        if run_pass:
            compare = compares_router_replay(self.job, batch)
            outputs = policy.forward_outputs(rows, batch, ("logprobs", *(ROUTER_REPLAY_OUTPUTS if compare else ())))
            batch.tensors["old_logprobs"] = outputs["logprobs"] * batch["loss_mask"]
            metrics.update(router_replay_metrics(batch, outputs))
        elif alg.recompute_old_logprobs:
            mark_old_from_training_forward(batch)  # the training forward's own log-probs stand in
        else:
            batch.tensors["old_logprobs"] = batch["rollout_logprobs"].clone()
        if self.run.needs_reference:
            batch.tensors["ref_logprobs"] = (policy.forward(rows, batch, "logprobs", reference=True)
                                             * batch["loss_mask"])
        metrics["timing/old_logprobs"] = time.perf_counter() - t0
        passes = int(run_pass) + int(self.run.needs_reference)
        if self.run.critic is not None:
            batch.tensors["values"] = self.run.critic.values(batch, rows)
        if self.run.teachers is not None:  # the teacher actor scores the rows the policy group shipped
            metrics.update(self.run.teachers.apply(batch, rows))
        # corrections, token rewards, advantages and returns, the train-inference gap: once, here
        metrics.update(self.run.algorithm.prepare(batch))
        metrics.update(self.train(batch, step))
        metrics.update(self.phase_mfu(batch, metrics, scoring_passes=passes))
        every = alg.ref_update_every
        if self.run.needs_reference and every > 0 and (step + 1) % every == 0:
            policy.call("refresh_reference")
        return metrics, float(batch["loss_mask"].sum())

    def flops_setup(self) -> tuple[ModelShape | None, float, int, int, bool]:
        """The model's shape, one device's peak FLOP/s, the trainer's and the engines' device counts
        (1 each on a CPU: the ranks share the machine), and whether the trainer runs a group's
        prompt once; asked of trainer rank 0 once per run."""
        cached = self._flops_setup
        if cached is None:
            assert self.run.actors is not None
            shape = ModelShape.from_job(self.job)
            peak, trainers, engines, shares = 0.0, 1, 1, False
            if shape is not None:
                info = gather([self.run.actors.trainers[0].peak_flops.remote()])[0]
                peak, shares = float(info["peak"]), bool(info.get("shares_prompts"))
                if info["device"] != "cpu":
                    trainers, engines = len(self.run.actors.trainers), max(1, len(self.run.actors.engine_urls))
            cached = self._flops_setup = (shape, peak, trainers, engines, shares)
        return cached

    def phase_mfu(self, batch: Batch, metrics: dict[str, float], *, scoring_passes: int) -> dict[str, float]:
        """``perf/mfu_train`` and ``perf/mfu_logprob`` of the step's policy training and scoring
        passes (old log-probs, reference) from their model FLOPs (:mod:`loongsage_core.flops`;
        each group's prompt once when the trainer runs it once)."""
        shape, peak, trainers, _, shares = self.flops_setup()
        if shape is None or peak <= 0:
            return {}
        scored = scoring_flops(shape, batch, shared_prompts=shares)
        out = {"perf/peak_tflops": peak / 1e12,
               "perf/mfu_train": mfu(3.0 * scored * self.job.train.ppo_epochs, metrics.get("timing/policy_train", 0.0),
                                     peak, trainers)}
        if scoring_passes:
            out["perf/mfu_logprob"] = mfu(scored * scoring_passes, metrics.get("timing/old_logprobs", 0.0), peak,
                                          trainers)
        return out

    def rollout_mfu(self, seconds: float) -> dict[str, float]:
        """``perf/mfu_rollout``: the generation FLOPs of the step's trained rows over ``seconds``."""
        shape, peak, _, engines, _ = self.flops_setup()
        if shape is None or peak <= 0 or self.last_batch is None or not len(self.last_batch):
            return {}
        return {"perf/mfu_rollout": mfu(generation_flops(shape, self.last_batch), seconds, peak, engines)}

