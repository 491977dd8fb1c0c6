"""One synchronous step of the RL loop: collect groups, learn on them, move the weights.

::

    prompts -> engines generate (tokens, log-probs, weight version) -> rewards -> filters
            -> rows, shipped to the actors once (WorkerGroup.share)
            -> old log-probs (recomputed, unless the training forward's own serve:
               algorithms/old_logprobs.py) [-> reference log-probs] [-> teachers] [-> values]
            -> StepAlgorithm.prepare (corrections, token rewards, advantages, the k3 gap)
            -> the prepared rows, shipped once -> policy epochs [-> critic epochs]
            -> weights to engines (version += 1)

:class:`StepRunner` is a part of :class:`.run.RLController` (it reads the controller's state:
``job``, ``actors``, ``critic``, ``algorithm``, ``mixer``, ...). The algorithm of the step is
:class:`loongsage_core.algorithms.StepAlgorithm`; the actors are reached through
:class:`.worker_group.WorkerGroup` (one sharding rule, one shipment of the rows per stage).
"""

from __future__ import annotations

import json
import time
from typing import Any, Sequence

from loongsage_hookspecs import Batch, TrajectoryGroup

from ..algorithms.old_logprobs import (
    compares_router_replay,
    mark_old_from_training_forward,
    old_from_training_forward,
    old_logprob_pass,
)
from ..algorithms.step import ROUTER_REPLAY_OUTPUTS, router_replay_metrics
from ..flops import ModelShape, generation_flops, mfu, scoring_flops
from .batching import build_batch, credit_options
from .metrics import rollout_metrics
from .mixing import interleave_by_source
from .remote import gather, own_time, waited_s
from .state import RunState
from .worker_group import WorkerGroup, mean_metrics

TRAINED_PROMPTS = "trained_prompts.jsonl"
CONTROLLER_OVERHEAD = "timing/controller_overhead"
"""The controller's own work in a step (seconds): building and padding the batch, advantages,
shipping rows, bookkeeping; the rollout and the time spent waiting on actors and engines excluded."""


class StepRunner(RunState):
    """Collect, learn and weight pushes of one step (a part of :class:`.run.RLController`, whose
    ``__init__`` and ``start`` set the state read here)."""

    @property
    def policy(self) -> WorkerGroup:
        """The trainer ranks (each holding the policy and, when needed, the reference model)."""
        assert self.actors is not None
        return WorkerGroup(self.actors.trainers, self.actors.dp_ranks, self.actors.dp_size,
                           balance_tokens=bool(self.job.train.max_tokens_per_micro_batch))

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
            before = self.filters.dropped
            kept.extend(self.filters.accept(groups))
            dropped += self.filters.dropped - before
            attempts += 1
            if attempts > self.job.algorithm.max_filter_retries:
                break
        self.sampled_groups = sampled  # the rollout records keep the filtered-out groups too
        metrics = rollout_metrics(sampled)
        metrics["rollout/filter_drop"] = float(dropped)
        metrics["rollout/filter_attempts"] = float(attempts)
        metrics["rollout/groups_trained"] = float(len(kept))
        return kept, metrics

    def mini_batch_order(self, batch: Batch, step: int) -> list[int]:
        """The step's rows in mini-batch order: interleaved so every mini-batch and every rank
        carries each source's share (the policy and the critic train on the same mini-batches)."""
        assert self.actors is not None
        return interleave_by_source(batch.meta["source"], self.job.train.mini_batch_size, self.actors.dp_size,
                                    seed=f"{self.job.run.seed}:{step}:minibatch")

    def train(self, batch: Batch, step: int) -> dict[str, float]:
        """Ship the prepared rows (advantages, returns) once, then ``[train] ppo_epochs`` passes
        over the policy's mini-batches and, with a critic, the critic's epochs on the same rows."""
        policy = self.policy
        shared = policy.share(batch)
        order = self.mini_batch_order(batch, step)
        size = self.job.train.mini_batch_size
        mini_batches = [mb for _ in range(self.job.train.ppo_epochs)
                        for mb in self.algorithm.mini_batch_rows(batch, order, size)]
        t0 = time.perf_counter()
        out, count = policy.train(shared, mini_batches, batch)
        out["timing/policy_train"] = time.perf_counter() - t0
        out["train/num_mini_batches"] = float(count)
        if old_from_training_forward(batch) and count == 1:  # keep them for the records
            old = policy.training_forward_logprobs(batch, mini_batches[0][0])
            if old is not None:
                batch.tensors["old_logprobs"] = old * batch["loss_mask"]
        if self.critic is not None:
            out.update(self.critic.train(batch, step, self.algorithm, order, shared))
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
        assert self.actors is not None
        t0 = time.perf_counter()
        batch = build_batch(groups, pad_id=self.tokenizer.pad_token_id or 0,
                            mask_stale=self.job.rollout.partial and self.job.rollout.partial_mask_stale,
                            **credit_options(self.job, self.host))  # which failures count, and how small a group
        self.last_batch = batch
        metrics: dict[str, float] = {"rollout/num_rows": float(len(batch))}
        if not len(batch):
            return metrics, 0.0
        alg = self.job.algorithm
        policy = self.policy
        run_pass, _ = old_logprob_pass(self.job, batch, version=self.version, needed_before_training=(
            self.algorithm.needs_old_logprobs_before_training or self.teachers is not None))
        metrics["perf/old_logprob_pass_skipped"] = float(alg.recompute_old_logprobs and not run_pass)
        needs_forward = run_pass or self.needs_reference or self.critic is not None
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
        if self.needs_reference:
            batch.tensors["ref_logprobs"] = (policy.forward(rows, batch, "logprobs", reference=True)
                                             * batch["loss_mask"])
        metrics["timing/old_logprobs"] = time.perf_counter() - t0
        passes = int(run_pass) + int(self.needs_reference)
        if self.critic is not None:
            batch.tensors["values"] = self.critic.values(batch, rows)
        if self.teachers is not None:  # the teacher actor scores the rows the policy group shipped
            metrics.update(self.teachers.apply(batch, rows))
        # corrections, token rewards, advantages and returns, the train-inference gap: once, here
        metrics.update(self.algorithm.prepare(batch))
        metrics.update(self.train(batch, step))
        metrics.update(self.phase_mfu(batch, metrics, scoring_passes=passes))
        every = alg.ref_update_every
        if self.needs_reference and every > 0 and (step + 1) % every == 0:
            policy.call("refresh_reference")
        return metrics, float(batch["loss_mask"].sum())

    def flops_setup(self) -> tuple[ModelShape | None, float, int, int, bool]:
        """The model's shape, one device's peak FLOP/s, the trainer's and the engines' device counts
        (1 each on a CPU: the ranks share the machine), and whether the trainer runs a group's
        prompt once; asked of trainer rank 0 once per run."""
        cached = getattr(self, "_flops_setup", None)
        if cached is None:
            assert self.actors is not None
            shape = ModelShape.from_job(self.job)
            peak, trainers, engines, shares = 0.0, 1, 1, False
            if shape is not None:
                info = gather([self.actors.trainers[0].peak_flops.remote()])[0]
                peak, shares = float(info["peak"]), bool(info.get("shares_prompts"))
                if info["device"] != "cpu":
                    trainers, engines = len(self.actors.trainers), max(1, len(self.actors.engine_urls))
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

    def run_step(self, step: int) -> dict[str, float]:
        """One synchronous step: collect, learn, then move the weights to the idle engines."""
        t0 = time.perf_counter()
        assert self.phases is not None
        groups, metrics = self.collect(step)
        t_rollout, waited = time.perf_counter(), waited_s()
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
        metrics.update(self.rollout_mfu(t_rollout - t0))
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
