"""The critic (value model) of jobs whose advantage estimator sets ``needs_critic`` (``gae``).

The critic lives in Ray actors of its own, ``[critic] num_workers`` data-parallel ranks (one
:class:`CriticActor` each, reserving ``[critic] cpus`` / ``gpus``), each holding the train
backend's worker built with ``TrainWorkerContext.role = "critic"``: a value model whose
``forward`` returns ``{"values": [B, T]}`` aligned with the tokens like log-probs (``values[:, t]``
estimates the return from token ``t`` onwards) and whose ``train_mini_batch`` minimises the
clipped value loss on ``values`` (rollout-time) and ``returns`` (targets).

In one step of the loop (:class:`loongsage_core.controller.run.RLController`)::

    rows -> Critic.values(batch) -> batch["values"] -> advantage (values=..., gives returns)
         -> policy update -> Critic.train(batch, step, algorithm, order) -> weights to engines

Checkpoints: each critic rank writes ``checkpoints/step_<N>/critic_rank_<r>/`` next to the
trainer ranks' ``rank_<r>/``, before ``controller.json`` completes the checkpoint; a resumed run
loads them back. Metrics: ``train/critic_loss``, ``train/value_mean``, ``train/value_clip_frac``,
``train/critic_grad_norm``, ``train/critic_lr`` (means over the step's critic mini-batches) and
``train/explained_variance`` of the rollout-time values against the returns (whole step).
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

import torch

from loongsage_hookspecs import Batch, TrainWorkerContext

from ..config import ConfigError, JobConfig
from ..plugins import PluginHost
from ..rendezvous import Rendezvous, host_rendezvous
from . import checkpoint as ckpt
from .batching import shard_rows
from .remote import gather

CRITIC_RANK_DIR = "critic_rank_{rank}"
"""Directory of critic rank ``r`` inside a checkpoint's ``step_<N>/``."""


def critic_rank_dir(output_dir: Path, step: int, rank: int) -> Path:
    return ckpt.step_dir(output_dir, step) / CRITIC_RANK_DIR.format(rank=rank)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float | None:
    """``1 - Var[R - V] / Var[R]`` over the tokens where ``mask`` is set, in float64.

    1 is a perfect critic, 0 one no better than the mean return, negative one worse than that.
    ``None`` when it is undefined: no masked token, or returns without spread.
    """
    on = mask > 0
    if tuple(values.shape) != tuple(returns.shape) or tuple(values.shape) != tuple(mask.shape):
        raise ValueError(f"explained_variance: values {tuple(values.shape)}, returns {tuple(returns.shape)} and "
                         f"mask {tuple(mask.shape)} must have the same shape")
    r = returns.double()[on]
    if r.numel() == 0:
        return None
    var_r = torch.var(r, unbiased=False)
    if float(var_r) == 0.0:
        return None
    resid = r - values.double()[on]
    return float(1.0 - torch.var(resid, unbiased=False) / var_r)


class CriticActor:
    """One critic rank in its own process (wrapped with ``ray.remote`` by :class:`Critic`)."""

    def __init__(self, job: JobConfig, rank: int, world_size: int) -> None:
        self.job = job
        self.host = PluginHost.from_job(job)
        self.worker: Any = None
        self.rank = rank
        self.world_size = world_size
        self.rendezvous: Rendezvous | None = None

    def host_rendezvous(self) -> tuple[str, int]:
        """Critic rank 0: listen for the critic group's rendezvous; returns ``(address, port)``."""
        if self.rank != 0:
            raise RuntimeError(f"critic rank {self.rank} asked to host the rendezvous; rank 0 hosts it")
        self.rendezvous = host_rendezvous()
        return self.rendezvous.address, self.rendezvous.port

    def start(self, master_addr: str, master_port: int) -> None:
        """Build the critic worker, joining the critic group at ``master_addr:master_port``."""
        spec = self.host.get("train_backend", self.job.train.backend)
        ctx = TrainWorkerContext(job=self.job, components=self.host, rank=self.rank, world_size=self.world_size,
                                 master_addr=master_addr, master_port=master_port, role="critic")
        self.worker = spec.factory(ctx)

    def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "rank": self.rank}

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        return self.worker.forward(batch)

    def train_mini_batch(self, batch: Batch, norm: Any) -> dict[str, float]:
        return self.worker.train_mini_batch(batch, norm)

    def save_checkpoint(self, path: str) -> None:
        self.worker.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.worker.load_checkpoint(path)

    def shutdown(self) -> None:
        close = getattr(self.worker, "close", None)
        if close is not None:
            close()


def check_critic_resources(job: JobConfig, cluster: dict[str, float]) -> None:
    """Fail fast, naming the keys, when the cluster cannot hold the critic next to the other actors."""
    from .placement import required_resources

    crit = job.critic
    others = required_resources(job)
    need = {"CPU": crit.num_workers * crit.cpus, "GPU": crit.num_workers * crit.gpus}
    for res, amount in need.items():
        total = others[res] + amount
        if amount > 0 and total > cluster.get(res, 0.0) + 1e-9:
            raise ConfigError(
                f"{job.source_path or '<job>'}: the critic needs {amount:g} {res} on top of the {others[res]:g} of the "
                f"trainers and engines, but the Ray cluster has {cluster.get(res, 0.0):g}; lower critic.{res.lower()}s "
                f"or critic.num_workers, or start a bigger cluster (run.ray_num_cpus)")


class Critic:
    """The controller's handle on the critic ranks: values, training, checkpoints."""

    def __init__(self, job: JobConfig, actors: list[Any]) -> None:
        self.job = job
        self.actors = actors

    @classmethod
    def create(cls, job: JobConfig) -> "Critic":
        """Start ``[critic] num_workers`` critic ranks on the (already initialised) Ray cluster."""
        import ray

        check_critic_resources(job, ray.cluster_resources())
        crit = job.critic
        world = crit.num_workers
        remote = ray.remote(CriticActor)
        # Ray actor handles are typed Any, as in placement.py: Ray's stubs do not type actor method calls
        actors: list[Any] = [remote.options(num_cpus=crit.cpus, num_gpus=crit.gpus).remote(job, rank, world)
                             for rank in range(world)]
        try:
            # several ranks: rank 0 listens first (a port the OS assigns) and reports where; then all join
            address, port = ray.get(actors[0].host_rendezvous.remote()) if world > 1 else ("127.0.0.1", 0)
            ray.get([a.start.remote(address, port) for a in actors])
            ray.get([a.ready.remote() for a in actors])
        except Exception:
            for a in actors:
                ray.kill(a)
            raise
        return cls(job, actors)

    # -- per step --------------------------------------------------------------------------------

    def values(self, batch: Batch) -> torch.Tensor:
        """Critic values ``[B, T]`` of every row (float32, 0 off ``loss_mask``)."""
        calls = [a.forward.remote(batch.select(rows))
                 for a, rows in zip(self.actors, shard_rows(len(batch), len(self.actors))) if rows]
        width = batch["input_ids"].shape[1]
        parts = [torch.nn.functional.pad(o["values"], (0, width - o["values"].shape[1])) for o in gather(calls)]
        return torch.cat(parts, 0).float() * batch["loss_mask"].float()

    def train(self, batch: Batch, step: int, algorithm: Any, order: Sequence[int]) -> dict[str, float]:
        """Train on the step's rows (``values`` and ``returns`` set) in mini-batches.

        ``algorithm`` is the step's :class:`~loongsage_core.algorithms.StepAlgorithm` and ``order``
        the rows in the policy's mini-batch order: with ``[critic] mini_batch_size`` unset the
        critic trains on exactly the policy's mini-batches, with the same aggregation norms.
        Epochs are ``[critic]``'s, else ``[train]``'s; each mini-batch is split over the critic
        ranks with its global norm, like the policy's.
        """
        for key in ("values", "returns"):
            if key not in batch:
                raise KeyError(f"Critic.train: the batch has no {key!r} tensor; the advantage estimator "
                               f"{self.job.algorithm.advantage!r} must return returns for the critic")
        crit, train = self.job.critic, self.job.train
        out: dict[str, float] = {}
        ev = explained_variance(batch["values"], batch["returns"], batch["loss_mask"])
        if ev is not None:
            out["train/explained_variance"] = ev
        size = crit.mini_batch_size or train.mini_batch_size
        sums: dict[str, float] = defaultdict(float)
        count = 0
        for _epoch in range(crit.ppo_epochs or train.ppo_epochs):
            for mini, norm in algorithm.mini_batches(batch, order, size):
                shards = shard_rows(len(mini), len(self.actors))
                per_rank = gather([a.train_mini_batch.remote(mini.select(rows), norm)
                                   for a, rows in zip(self.actors, shards)])
                for key, value in per_rank[0].items():  # equal on every rank (all-reduced)
                    sums[key] += float(value)
                count += 1
        out.update({k: v / max(count, 1) for k, v in sums.items()})
        out["train/critic_num_mini_batches"] = float(count)
        return out

    # -- checkpoints -----------------------------------------------------------------------------

    def save(self, output_dir: Path, step: int) -> None:
        """Write every rank's ``critic_rank_<r>/`` into checkpoint ``step`` (before ``controller.json``)."""
        import ray

        ray.get([a.save_checkpoint.remote(str(critic_rank_dir(output_dir, step, r)))
                 for r, a in enumerate(self.actors)])

    def load(self, output_dir: Path, step: int) -> None:
        """Restore every rank from checkpoint ``step``; a checkpoint without a critic is an error."""
        import ray

        first = critic_rank_dir(output_dir, step, 0)
        if not first.is_dir():
            raise FileNotFoundError(f"resume: checkpoint '{ckpt.step_dir(output_dir, step)}' has no critic "
                                    f"('{first.name}/'); it was written by a run without a critic")
        ray.get([a.load_checkpoint.remote(str(critic_rank_dir(output_dir, step, r)))
                 for r, a in enumerate(self.actors)])

    def close(self) -> None:
        import ray

        for a in self.actors:
            try:
                ray.get(a.shutdown.remote())
            except Exception:  # an actor that already died has nothing left to close
                pass
            ray.kill(a)
        self.actors = []
