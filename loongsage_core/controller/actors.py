"""Ray actors that hold models: trainer ranks (optionally with a colocated engine) and engines.

Each actor rebuilds the plugin host from the job (so user hookimpl modules load there too) and
builds its components through their factories: the train backend's worker, a frozen reference
worker when a KL term needs one (unless the policy worker scores the reference itself: a LoRA
policy with its adapter disabled, ``serves_reference``), and the rollout engine, whose HTTP server runs in a background
thread of the actor and is reached by URL like any SGLang server. The engine listens on its node's
address (Ray's node IP: loopback on a local cluster, the machine's address on a multi-node one)
and its URL carries that address.

A colocated actor (trainer and engine in one process) gives back the trainer thread's idle
OpenMP workers after each call that computes (:mod:`loongsage_core.openmp`): the engine then
decodes as fast as alone, and the engine's loop thread ends when idle, so the trainer trains as
fast as alone.

The run secret comes in as a constructor argument (never through the environment): the engine
requires it on its endpoints, and weight transports and engine clients built in the actor send it
(:func:`loongsage_core.security.set_process_secret`).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, Callable, TypeVar

from loongsage_hookspecs import (
    AggregationNorm,
    Batch,
    EngineContext,
    LoraAwareSender,
    LoraTrainer,
    ModelParallel,
    Offloadable,
    OnDevice,
    ReusesTrainingLogprobs,
    SharesPrompts,
    TrainWorkerContext,
    WeightTransportContext,
)

from ..config import JobConfig, component_ref
from ..openmp import release_idle_threads
from ..plugins import PluginHost
from ..rendezvous import Rendezvous, host_rendezvous, reachable_address
from ..security import set_process_secret

F = TypeVar("F", bound=Callable[..., Any])


def computes(method: F) -> F:
    """A :class:`ModelActor` method that runs the trainer's operators: in a colocated actor, the
    calling thread's idle OpenMP workers are given back when it returns (module docstring)."""

    @functools.wraps(method)
    def run(self: "ModelActor", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        finally:
            if self.engine is not None and self.worker is not None:
                release_idle_threads()

    return run  # type: ignore[return-value]


class ModelActor:
    """One trainer rank and/or one rollout engine living in one process.

    ``rank is None`` means engine only; ``engine_index is None`` means trainer only; both set is the
    colocated layout where the engine receives weights in-process.

    Built in two steps so that no port is picked in one process and bound in another: the
    driver creates every actor, asks trainer rank 0 to :meth:`host_rendezvous` (it listens on a
    port the OS assigns and reports its address and port), then calls :meth:`start` on every
    actor with that address, which builds the models (the trainer ranks join the group there).
    """

    def __init__(self, job: JobConfig, rank: int | None, world_size: int, engine_index: int | None,
                 needs_reference: bool, secret: str | None = None) -> None:
        set_process_secret(secret)
        self.secret = secret
        self.job = job
        self.host = PluginHost.from_job(job)
        self.worker: Any = None
        self.reference: Any = None
        self.engine: Any = None
        self.engine_url: str | None = None
        self.rank = rank
        self.world_size = world_size
        self.engine_index = engine_index
        self.needs_reference = needs_reference
        self.rendezvous: Rendezvous | None = None
        self._sender: Any = None  # the weight transport's sender, built on the first push

    def host_rendezvous(self) -> tuple[str, int]:
        """Trainer rank 0: listen for the trainer group's rendezvous; returns ``(address, port)``."""
        if self.rank != 0:
            raise RuntimeError(f"trainer rank {self.rank} asked to host the rendezvous; rank 0 hosts it")
        self.rendezvous = host_rendezvous()
        return self.rendezvous.address, self.rendezvous.port

    @computes
    def start(self, master_addr: str, master_port: int) -> None:
        """Build the trainer worker (joining the group at ``master_addr:master_port``), the
        reference worker and the engine this actor holds."""
        job = self.job
        if self.rank is not None:
            backend = component_ref(job, "train.backend")
            ctx = TrainWorkerContext(where=backend.where, job=job, components=self.host, rank=self.rank,
                                     world_size=self.world_size, master_addr=master_addr, master_port=master_port,
                                     role="actor")
            self.worker = self.host.bind(backend, ctx)
            serves_reference = isinstance(self.worker, LoraTrainer) and self.worker.serves_reference
            if self.needs_reference and not serves_reference:
                ref_ctx = TrainWorkerContext(where=f"{backend.where} (reference)", job=job, components=self.host,
                                             rank=0, world_size=1, role="reference")
                self.reference = self.host.bind(backend, ref_ctx)
        if self.engine_index is not None:
            # listen on this node's address (loopback on a local cluster) and advertise it: the
            # driver, the router and trainers on other nodes reach the engine there
            engine = component_ref(job, "rollout.engine")
            engine_ctx = EngineContext(where=engine.where, job=job, components=self.host,
                                       engine_index=self.engine_index, api_key=self.secret, host=reachable_address())
            self.engine = self.host.bind(engine, engine_ctx)
            self.engine_url = self.engine.start()

    def ready(self) -> dict[str, Any]:
        """Where this actor stands: its engine URL and, for a trainer rank, its data-parallel rank
        and size (a backend with model parallelism has several ranks per data-parallel rank)."""
        info: dict[str, Any] = {"pid": os.getpid(), "engine_url": self.engine_url, "rank": self.rank}
        if self.worker is not None and self.rank is not None:  # a trainer rank
            parallel = isinstance(self.worker, ModelParallel)
            info["dp_rank"] = int(self.worker.data_parallel_rank if parallel else self.rank)
            info["dp_size"] = int(self.worker.data_parallel_size if parallel else self.world_size)
        return info

    @computes
    def forward(self, batch: Batch) -> dict[str, Any]:
        return self.worker.forward(batch)

    @computes
    def reference_forward(self, batch: Batch) -> dict[str, Any]:
        if self.reference is None:  # the policy scores its own reference (LoRA: the adapter disabled)
            return self.worker.reference_forward(batch)
        return self.reference.forward(batch)

    @computes
    def train_mini_batch(self, batch: Batch, norm: AggregationNorm) -> dict[str, float]:
        return self.worker.train_mini_batch(batch, norm)

    def forward_rows(self, batch: Batch, rows: list[int], reference: bool = False) -> dict[str, Any]:
        """:meth:`forward` (or :meth:`reference_forward`) of rows ``rows`` of the step's shared batch
        (:class:`.worker_group.WorkerGroup`: the driver ships the batch once, each rank selects)."""
        rows_batch = batch.select(rows)
        return self.reference_forward(rows_batch) if reference else self.forward(rows_batch)

    def train_rows(self, batch: Batch, rows: list[int], norm: AggregationNorm) -> dict[str, float]:
        """:meth:`train_mini_batch` on rows ``rows`` of the step's shared batch."""
        return self.train_mini_batch(batch.select(rows), norm)

    @computes
    def peak_flops(self) -> dict[str, Any]:
        """The peak FLOP/s of this trainer rank's device (``[train] peak_tflops``, the accelerator
        table, or a matmul probe here), the device type, and whether the worker runs a group's
        prompt once (:class:`SharesPrompts`), for the ``perf/mfu_*`` metrics."""
        from ..flops import device_peak_flops

        device = self.worker.device if isinstance(self.worker, OnDevice) else "cpu"
        peak = device_peak_flops(device, self.job.model.dtype, self.job.train.peak_tflops)
        shares = isinstance(self.worker, SharesPrompts) and bool(self.worker.share_prompts)
        return {"peak": peak, "device": str(getattr(device, "type", device)), "shares_prompts": shares}

    def training_forward_logprobs(self) -> Any:
        """This rank's detached log-probs ``[b, T]`` of its rows of the last mini-batch when they
        were the step's old log-probs (the separate pass was skipped), else ``None``."""
        return self.worker.training_forward_logprobs if isinstance(self.worker, ReusesTrainingLogprobs) else None

    @computes
    def offload(self) -> None:
        """Move the trainer's (and the reference model's) state off the accelerator, when the
        backend can (colocated runs, while the engine generates)."""
        for worker in (self.worker, self.reference):
            if isinstance(worker, Offloadable):
                worker.offload()

    @computes
    def onload(self) -> None:
        """Bring back what :meth:`offload` moved (before training)."""
        for worker in (self.worker, self.reference):
            if isinstance(worker, Offloadable):
                worker.onload()

    @computes
    def refresh_reference(self) -> None:
        """Copy the current policy weights into the frozen reference model."""
        self.reference.load_weights(self.worker.named_weights())

    @computes
    def push_weights(self, version: int, targets: list[Any] | None) -> dict[str, float]:
        """Send this rank's weights with the job's transport; ``None`` targets the local engine.

        ``[]``: this rank sends nowhere but still reads its weights, because with model
        parallelism reading them is a collective every rank of the model must join.
        """
        if targets is not None and not targets:
            for _ in self.worker.named_weights():
                pass
            return {}
        if self._sender is None:
            ref = component_ref(self.job, "rollout.weight_transport")
            ctx = WeightTransportContext(where=ref.where, job=self.job, components=self.host, role="sender")
            sender = self.host.bind(ref, ctx, using="sender")
            if self.job.train.lora is not None and isinstance(sender, LoraAwareSender):
                sender.configure_lora(self.job.train.lora)  # a sender writing adapter files needs rank/alpha
            self._sender = sender
        start = time.perf_counter()
        out = self._sender.send(self.worker.named_weights(), version, [self.engine] if targets is None else targets)
        stats = dict(out or {})
        stats.setdefault("seconds", time.perf_counter() - start)
        return stats

    @computes
    def save_checkpoint(self, path: str) -> None:
        self.worker.save_checkpoint(path)

    @computes
    def load_checkpoint(self, path: str) -> None:
        self.worker.load_checkpoint(path)

    @computes
    def save_hf(self, path: str) -> None:
        self.worker.save_hf(path)

    @computes
    def save_adapter(self, path: str) -> None:
        self.worker.save_adapter(path)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        if self._sender is not None:
            self._sender.close()
