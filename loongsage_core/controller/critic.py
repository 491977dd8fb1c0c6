"""The critic (value model) of jobs whose advantage estimator sets ``needs_critic`` (``gae``).

The critic lives in Ray actors of its own, ``[critic] num_workers`` data-parallel ranks (one
:class:`CriticActor` each, in a bundle of ``[critic] cpus`` / ``gpus`` of the run's placement
group), sharded and fed by a :class:`.worker_group.WorkerGroup` like the policy, each holding the train
backend's worker built with ``TrainWorkerContext.role = "critic"``: a value model whose
``forward`` returns ``{"values": [B, T]}`` aligned with the tokens like log-probs (``values[:, t]``
estimates the return from token ``t`` onwards) and whose ``train_mini_batch`` minimises the
clipped value loss on ``values`` (rollout-time) and ``returns`` (targets).

In one step of the loop (:class:`loongsage_core.controller.run.SyncLoop`)::

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
from pathlib import Path
from typing import Any, Sequence

import torch

from loongsage_hookspecs import Batch, Closeable, TrainWorkerContext

from ..config import ConfigError, JobConfig, component_ref
from ..plugins import PluginHost
from ..rendezvous import Rendezvous, host_rendezvous
from ..run_files import checkpoint as ckpt
from .worker_group import WorkerGroup

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
        ref = component_ref(self.job, "train.backend")
        ctx = TrainWorkerContext(where=f"{ref.where} (critic)", job=self.job, components=self.host, rank=self.rank,
                                 world_size=self.world_size, master_addr=master_addr, master_port=master_port,
                                 role="critic")
        self.worker = self.host.bind(ref, ctx)

    def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "rank": self.rank}

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        return self.worker.forward(batch)

    def train_mini_batch(self, batch: Batch, norm: Any) -> dict[str, float]:
        return self.worker.train_mini_batch(batch, norm)

    def forward_rows(self, batch: Batch, rows: list[int], reference: bool = False) -> dict[str, torch.Tensor]:
        """:meth:`forward` of rows ``rows`` of the step's shared batch (a critic has no reference)."""
        if reference:
            raise ValueError("a critic rank has no reference model")
        return self.forward(batch.select(rows))

    def train_rows(self, batch: Batch, rows: list[int], norm: Any) -> dict[str, float]:
        """:meth:`train_mini_batch` on rows ``rows`` of the step's shared batch."""
        return self.train_mini_batch(batch.select(rows), norm)

    def save_checkpoint(self, path: str) -> None:
        self.worker.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.worker.load_checkpoint(path)

    def shutdown(self) -> None:
        if isinstance(self.worker, Closeable):
            self.worker.close()


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
        self.group = WorkerGroup(actors)  # one data-parallel rank per critic actor

    @staticmethod
    def check_resources(job: JobConfig) -> None:
        """:func:`check_critic_resources` against the running Ray cluster (before the run's
        placement group reserves the critic's bundles, which would wait forever)."""
        import ray

        check_critic_resources(job, ray.cluster_resources())

    @classmethod
    def create(cls, job: JobConfig, placement_group: Any = None, first_bundle: int = 0) -> "Critic":
        """Start ``[critic] num_workers`` critic ranks on the (already initialised) Ray cluster, in
        bundles ``first_bundle...`` of the run's ``placement_group`` (see
        :func:`.placement.create_placement_group`; ``None``: anywhere in the cluster)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if placement_group is None:
            check_critic_resources(job, ray.cluster_resources())
        crit = job.critic
        world = crit.num_workers
        remote = ray.remote(CriticActor)

        def options(rank: int) -> Any:
            if placement_group is None:
                return remote.options(num_cpus=crit.cpus, num_gpus=crit.gpus)
            strategy = PlacementGroupSchedulingStrategy(placement_group=placement_group,
                                                        placement_group_bundle_index=first_bundle + rank)
            return remote.options(num_cpus=crit.cpus, num_gpus=crit.gpus, scheduling_strategy=strategy)

        # Ray actor handles are typed Any, as in placement.py: Ray's stubs do not type actor method calls
        actors: list[Any] = [options(rank).remote(job, rank, world) for rank in range(world)]
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

    def values(self, batch: Batch, shared: Any = None) -> torch.Tensor:
        """Critic values ``[B, T]`` of every row (float32, 0 off ``loss_mask``); ``shared`` is the
        batch as :meth:`.WorkerGroup.share` shipped it (shipped here when not given)."""
        shared = self.group.share(batch) if shared is None else shared
        return self.group.forward(shared, batch, "values") * batch["loss_mask"].float()

    def train(self, batch: Batch, step: int, algorithm: Any, order: Sequence[int],
              shared: Any = None) -> dict[str, float]:
        """Train on the step's rows (``values`` and ``returns`` set) in mini-batches; ``shared`` as
        in :meth:`values` (the batch with ``values`` and ``returns``).

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
        shared = self.group.share(batch) if shared is None else shared
        epochs = crit.ppo_epochs or train.ppo_epochs
        metrics, count = self.group.train(shared, (mb for _ in range(epochs)
                                                   for mb in algorithm.mini_batch_rows(batch, order, size)))
        out.update(metrics)
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
