"""Protocols of the objects that object-style component factories return.

These are structural types (``typing.Protocol``): a plugin implements the methods, it does not
subclass anything. The host only calls what is listed here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

    from .records import AgentContext, AgentResult, AggregationNorm, Batch, ExecResult, TrajectoryGroup


@runtime_checkable
class Agent(Protocol):
    """Runs one trajectory by talking OpenAI chat completions to ``ctx.base_url``."""

    async def run(self, ctx: "AgentContext") -> "AgentResult": ...


@runtime_checkable
class Sandbox(Protocol):
    """A per-trajectory isolated place to run commands."""

    workdir: str

    async def exec(self, command: str, *, timeout_s: float | None = None) -> "ExecResult": ...


@runtime_checkable
class SandboxProvider(Protocol):
    """Creates and destroys sandboxes; ``destroy`` is idempotent."""

    async def create(self, trajectory_id: str) -> Sandbox: ...

    async def destroy(self, sandbox: Sandbox) -> None: ...


@runtime_checkable
class RouterMiddleware(Protocol):
    """Sees every chat-completion request and response of the AgentFlow router, in job-file order."""

    def on_request(self, trajectory_id: str, request: dict[str, Any]) -> dict[str, Any]: ...

    def on_response(self, trajectory_id: str, request: dict[str, Any],
                    response: dict[str, Any]) -> dict[str, Any]: ...


@runtime_checkable
class Scheduler(Protocol):
    """Asynchronous-mode policy: how many prompts to have in flight, and what a step may train on.

    ``can_dispatch(in_flight, buffered, trainer_version)`` says whether to start another prompt
    group; ``select(buffer, trainer_version, batch_size)`` picks the groups for the next step (or
    ``None`` to wait); groups carry the weight versions of their tokens.
    """

    def can_dispatch(self, in_flight: int, buffered: int, trainer_version: int) -> bool: ...

    def select(self, buffer: list["TrajectoryGroup"], trainer_version: int,
               batch_size: int) -> list["TrajectoryGroup"] | None: ...


@runtime_checkable
class Teacher(Protocol):
    """A frozen model that scores the student's samples."""

    def forward(self, batch: "Batch", *, topk: int = 0) -> Any: ...


@runtime_checkable
class MetricsLogger(Protocol):
    """Receives the metrics of each step (a flat ``name -> number`` mapping)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class WeightSender(Protocol):
    """Trainer side of a weight transport: pushes named tensors into every target engine."""

    def send(self, weights: Iterable[tuple[str, "torch.Tensor"]], version: int,
             targets: list[Any]) -> dict[str, float]: ...

    def close(self) -> None: ...


@runtime_checkable
class WeightReceiver(Protocol):
    """Engine side of a weight transport: turns one update request's payload into tensors."""

    def receive(self, payload: Mapping[str, Any]) -> Iterator[tuple[str, "torch.Tensor"]]: ...


@attrs.define
class TrainWorkerContext:
    """What a train backend factory receives inside its trainer actor.

    ``job`` is the host's resolved job configuration (``loongsage_core.config.JobConfig``);
    ``components`` resolves ``(kind, name)`` to a spec (the host's plugin registry);
    ``rank``/``world_size`` and ``master_addr``/``master_port`` set up ``torch.distributed`` for
    data parallelism; ``role`` is ``"actor"``, ``"reference"`` or ``"critic"``.
    """

    job: Any
    components: Any
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    role: str = "actor"


@runtime_checkable
class TrainWorker(Protocol):
    """One data-parallel rank of a train backend."""

    def forward(self, batch: "Batch") -> dict[str, "torch.Tensor"]:
        """Per-token ``logprobs`` and ``entropy`` ``[B, T]`` (no gradient) for ``batch``."""
        ...

    def train_mini_batch(self, batch: "Batch", norm: "AggregationNorm") -> dict[str, float]:
        """Loss, backward over micro-batches, one optimizer step; returns ``train/*`` metrics."""
        ...

    def named_weights(self) -> Iterator[tuple[str, "torch.Tensor"]]:
        """Full (unsharded) weights under Hugging Face names, for weight transfer and export."""
        ...

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def save_hf(self, path: str) -> None:
        """Write a Hugging Face directory (config, safetensors, tokenizer) that transformers loads."""
        ...


@attrs.define
class EngineContext:
    """What a rollout engine factory receives inside its engine actor."""

    job: Any
    components: Any
    engine_index: int = 0
    host: str = "127.0.0.1"
    port: int = 0


@runtime_checkable
class RolloutEngine(Protocol):
    """A server that speaks SGLang's native HTTP API (``/generate``, ``/abort_request``, ...)."""

    def start(self) -> str:
        """Start serving; returns the base URL (``http://127.0.0.1:PORT``)."""
        ...

    def shutdown(self) -> None: ...
