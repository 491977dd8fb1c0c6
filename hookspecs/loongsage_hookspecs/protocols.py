"""Protocols of the objects that object-style component factories return.

These are structural types (``typing.Protocol``): a plugin implements the methods, it does not
subclass anything. The host only calls what is listed here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Protocol, runtime_checkable

import attrs

from .contexts import (
    BuildContext,
)
from .registry import ComponentRegistry
from .settings import JobSettings

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

    from .records import (
        AgentContext,
        AgentResult,
        AggregationNorm,
        Batch,
        ExecResult,
        TeacherOutputs,
        TrajectoryGroup,
    )


@runtime_checkable
class Agent(Protocol):
    """Runs one trajectory by talking OpenAI chat completions to ``ctx.base_url``."""

    async def run(self, ctx: "AgentContext") -> "AgentResult": ...


@runtime_checkable
class Sandbox(Protocol):
    """A per-trajectory isolated place to run commands.

    ``workdir`` is the directory the agent works in (the prepared repository, if the row named
    one). ``exec`` is for agents on the event loop; ``run`` is the same command run synchronously,
    for rewards (the host calls them in a worker thread, never on the event loop). A command past
    ``timeout_s`` is killed with every process it started and comes back with ``timed_out``.
    """

    workdir: str

    async def exec(self, command: str, *, timeout_s: float | None = None) -> "ExecResult": ...

    def run(self, command: str, *, timeout_s: float | None = None) -> "ExecResult": ...


@runtime_checkable
class SandboxProvider(Protocol):
    """Creates and destroys sandboxes; ``destroy`` is idempotent.

    ``create`` receives the trajectory's data row (``{"prompt", "label", "metadata"}``, or
    ``None``) and prepares the sandbox from what :func:`~loongsage_hookspecs.sandbox_request`
    reads in it: a repository snapshot, setup commands, environment variables. ``close`` (the
    host calls it once at the end of a run) destroys whatever the provider still holds.
    """

    async def create(self, trajectory_id: str, row: Mapping[str, Any] | None = None) -> Sandbox: ...

    async def destroy(self, sandbox: Sandbox) -> None: ...


@runtime_checkable
class RouterMiddleware(Protocol):
    """Sees every chat-completion request and response of the AgentFlow router, in job-file order."""

    def on_request(self, trajectory_id: str, request: dict[str, Any]) -> dict[str, Any]: ...

    def on_response(self, trajectory_id: str, request: dict[str, Any],
                    response: dict[str, Any]) -> dict[str, Any]: ...


@runtime_checkable
class Scheduler(Protocol):
    """Asynchronous-mode policy: what to generate next, what a step trains on, what to throw away.

    A scheduler is a deterministic state machine (no threads, no clocks): its state changes only
    through the event methods below, so the same calls always give the same decisions.

    Versions: ``trainer_version`` is the policy version the rollout engines serve. The controller
    raises it by one, and calls ``on_train_step``, after each train step once the engines hold the
    new weights. A group trained at version ``t`` has staleness ``t - v``, with ``v`` the oldest
    weight version among its generated tokens (``Segment.weight_versions``, -1 entries ignored);
    a strategy may offer other definitions. ``stale_steps`` bounds the staleness of every trained
    group.

    The controller owns the buffer: the finished, kept groups in completion order. One loop::

        for gid in scheduler.to_abort(version):             # can never be trained any more
            abort gid on the engines; scheduler.on_discard(gid)
        for group in scheduler.evict(buffer, version):      # too stale, or surplus
            buffer.remove(group)                            # drop it, or dispatch its prompt again
        batch = scheduler.select(buffer, version, batch_size)
        if batch is not None:
            remove batch from buffer; train; push weights; version += 1
            scheduler.on_train_step(version); log scheduler.metrics()
        while scheduler.can_dispatch(n_in_flight, len(buffer), version):
            scheduler.on_dispatch(group_id, version); start generating group_id
        # when a group finishes: kept by the filters -> scheduler.on_complete(group), buffer.append(group)
        #                        filtered, failed or aborted -> scheduler.on_discard(group.group_id)

    Optional, for several data sources (the host uses them when the factory takes ``quota``;
    a job with more than one ``[[data]]`` source needs a scheduler that does):

    * factory argument ``quota``: ``quota(version) -> {source name: groups}``, adding up to the
      batch size: the host's per-step rounding of the source weights (``floor`` or ``ceil`` of each
      share). The step at ``version`` must train exactly that many groups of each source.
    * ``next_source(trainer_version) -> str | None``: the source the next dispatched group should
      come from; the host draws that source's next prompt and calls
      ``on_dispatch(group_id, version, source=...)``.

    Optional, for checkpoints (see :class:`CheckpointableScheduler`): ``state_dict()`` and
    ``load_state_dict(state)``; the host saves the state with every checkpoint and loads it on
    resume, so a resumed run continues the same schedule.
    """

    def can_dispatch(self, in_flight: int, buffered: int, trainer_version: int) -> bool:
        """Whether one more prompt group may be dispatched now, given the controller's counts of
        groups generating (``in_flight``) and waiting in the buffer (``buffered``)."""
        ...

    def on_dispatch(self, group_id: str, version: int) -> None:
        """Group ``group_id`` was dispatched while the engines serve ``version``."""
        ...

    def on_complete(self, group: "TrajectoryGroup") -> None:
        """``group`` finished, passed the filters and enters the buffer."""
        ...

    def on_discard(self, group_id: str) -> None:
        """Live group ``group_id`` will never enter (or has left) the buffer: filtered out, failed,
        aborted, or removed by the controller; its place in the pipeline is free again."""
        ...

    def to_abort(self, trainer_version: int) -> list[str]:
        """Ids of groups still generating that can no longer be trained (a read; the controller may
        abort them and call ``on_discard``, or let them finish and ``evict`` returns them)."""
        ...

    def evict(self, buffer: list["TrajectoryGroup"], trainer_version: int) -> list["TrajectoryGroup"]:
        """The buffered groups that can no longer be trained (staleness above the bound, or unused
        surplus); they leave the scheduler's view and the controller removes them from ``buffer``."""
        ...

    def select(self, buffer: list["TrajectoryGroup"], trainer_version: int,
               batch_size: int | None = None) -> list["TrajectoryGroup"] | None:
        """The ``batch_size`` groups of ``buffer`` the next step trains on, or ``None`` to wait.

        No selected group exceeds the staleness bound. ``batch_size``, when given, must equal the
        one the scheduler was built with.
        """
        ...

    def on_train_step(self, new_version: int) -> None:
        """The step that trained the last selected batch is done and the engines serve
        ``new_version`` (that batch's version + 1)."""
        ...

    def metrics(self) -> dict[str, float]:
        """``rollout/*`` numbers for the step log (a read): at least ``rollout/staleness_mean`` and
        ``rollout/staleness_max`` of the last selected batch, ``rollout/pipeline_buf_size`` and the
        dropped-group counts."""
        ...


@runtime_checkable
class CheckpointableScheduler(Protocol):
    """A :class:`Scheduler` whose state survives a checkpoint (optional methods of a scheduler).

    ``state_dict()`` returns a JSON-serialisable mapping (the host writes it into the checkpoint's
    ``controller.json``); ``load_state_dict(state)`` continues from it in a fresh scheduler before
    anything is dispatched. A resumed run generates the prompts of every group that was generating
    or buffered again, so the state need not (and should not) hold live groups: it holds what
    outlives them (the version, counters, any position in a schedule).
    """

    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class Teacher(Protocol):
    """A frozen model that scores the student's samples."""

    def forward(self, batch: "Batch", *, topk: int = 0) -> Any: ...


@runtime_checkable
class TeacherRouter(Protocol):
    """What a teacher manager's factory returns: routes rows to teachers, bounds residency.

    ``forward`` gives teacher outputs for the rows whose source has a teacher (the others are
    zeros, see ``row_mask``), in the batch's row order; ``plan`` says which teacher scores which
    rows; ``resident`` lists the teachers loaded now; ``loads`` counts loads so far.
    """

    @property
    def resident(self) -> tuple[str, ...]: ...

    @property
    def loads(self) -> int: ...

    def plan(self, batch: "Batch") -> dict[str, list[int]]: ...

    def row_mask(self, batch: "Batch") -> "torch.Tensor": ...

    def forward(self, batch: "Batch", *, topk: int = 0, return_logits: bool = False) -> "TeacherOutputs": ...

    def offload_all(self) -> None: ...


@runtime_checkable
class MetricsLogger(Protocol):
    """Receives the metrics of each step (a flat ``name -> number`` mapping)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...

    # optional: ``truncate_after(step)`` and ``log_trajectories(step, records)`` (see the hookspec)


@runtime_checkable
class EngineRouter(Protocol):
    """A load balancer in front of the engines (cache-aware routing of generation requests)."""

    def start(self) -> str:
        """Start serving; returns the base URL that speaks the engines' ``/generate``."""
        ...

    def shutdown(self) -> None: ...

    # optional: ``add_engine(url)`` and ``remove_engine(url)``, blocking until the router routes
    # accordingly; the controller calls them when it replaces an engine that died behind the router


@runtime_checkable
class WeightSender(Protocol):
    """Trainer side of a weight transport: pushes named tensors into every target engine.

    In a ``[train] lora`` run the tensors are the adapter alone (:mod:`loongsage_hookspecs.lora`);
    a transport that moves named tensors carries it unchanged. A sender that must know the
    adapter's settings (to write an adapter directory for its engines) may also have
    ``configure_lora(settings: LoraSettings) -> None``, which the host calls once, before the
    first ``send`` of a LoRA run.

    ``send`` returns metrics of the update; the host logs them as ``perf/weight_sync_<key>``,
    except keys that already start with ``perf/weight_sync_`` (``perf/weight_sync_bytes``, the
    bytes this sync moved, and ``perf/weight_sync_delta_ratio``, their share of a full sync's),
    which keep their names.
    """

    def send(self, weights: Iterable[tuple[str, "torch.Tensor"]], version: int,
             targets: list[Any]) -> dict[str, float]: ...

    def close(self) -> None: ...


@runtime_checkable
class WeightReceiver(Protocol):
    """Engine side of a weight transport: turns one update request's payload into tensors."""

    def receive(self, payload: Mapping[str, Any]) -> Iterator[tuple[str, "torch.Tensor"]]: ...


@attrs.define(frozen=True, kw_only=True)
class TrainWorkerContext(BuildContext):
    """What a train backend factory receives inside its trainer actor (a :class:`BuildContext`).

    ``job`` (required here) is the job as a backend may read it
    (:class:`~loongsage_hookspecs.settings.JobSettings`: the host passes its resolved job, which
    satisfies it);
    ``components`` resolves ``(kind, name)`` to a spec (the host's plugin registry, a
    :class:`~loongsage_hookspecs.registry.ComponentRegistry`; ``None`` outside a run);
    ``rank``/``world_size`` and ``master_addr``/``master_port`` set up ``torch.distributed`` for
    data parallelism; ``role`` is ``"actor"``, ``"reference"`` or ``"critic"``.
    """

    job: JobSettings
    components: ComponentRegistry | None
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    role: str = "actor"


@runtime_checkable
class TrainWorker(Protocol):
    """One rank of a train backend.

    A backend with model parallelism (several ranks per model replica) also exposes
    ``data_parallel_rank`` and ``data_parallel_size``: the controller then splits rows over
    replicas and gives every rank of one replica the same rows. Without them each rank is its
    own replica (rank ``ctx.rank`` of ``ctx.world_size``).

    A backend whose spec declares ``supports_lora`` trains a ``[train] lora`` adapter; its workers
    then also have ``serves_reference`` (true: no reference worker is built), ``reference_forward``
    (:meth:`forward` with the adapter disabled: the KL reference) and ``save_adapter(path)`` (a
    PEFT adapter directory, written at the end of the run beside ``final_hf/``).
    """

    def forward(self, batch: "Batch") -> dict[str, "torch.Tensor"]:
        """Per-token ``logprobs`` and ``entropy`` ``[B, T]`` (no gradient) of the tokens in
        ``batch``'s ``loss_mask`` (0 at every other token; every real token without a loss mask):
        a backend need not compute the output layer for the prompts."""
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


@attrs.define(frozen=True, kw_only=True)
class EngineContext(BuildContext):
    """What a rollout engine factory receives inside its engine actor (a :class:`BuildContext`).

    ``api_key`` is the run secret: when set, the engine must refuse every endpoint except its
    health probes to requests without ``Authorization: Bearer <api_key>`` (SGLang's ``--api-key``
    and ``--admin-api-key``). ``None`` leaves the engine open (tests, a user's own process).
    ``host`` is the address to listen on and to put in the returned URL: the engine actor's node
    address (loopback on a one-machine cluster); beyond loopback an engine must refuse to start
    without ``api_key``. ``job`` and ``components`` are typed as in :class:`TrainWorkerContext`.
    """

    job: JobSettings
    components: ComponentRegistry | None
    engine_index: int = 0
    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = attrs.field(default=None, repr=False)


@runtime_checkable
class RolloutEngine(Protocol):
    """A server that speaks SGLang's native HTTP API (``/generate``, ``/abort_request``, ...)."""

    def start(self) -> str:
        """Start serving on ``EngineContext.host``; returns the base URL (``http://HOST:PORT``)."""
        ...

    def shutdown(self) -> None: ...
