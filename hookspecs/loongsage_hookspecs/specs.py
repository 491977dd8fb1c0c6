"""Typed component specs: what each provider hook returns.

Every hook returns an iterable of one spec class below. A spec names a component (the name a job
file uses), describes it in one line (shown by ``loongsage plugins``) and carries the callable the
host invokes. Function-style kinds (reward, advantage, policy loss, KL, filter, aggregation,
correction) carry the function itself; object-style kinds carry a ``factory`` that builds an
object implementing the matching protocol of :mod:`loongsage_hookspecs.protocols`. Every factory
is called one way, ``factory(ctx, **args)``: ``ctx`` the kind's context
(:mod:`loongsage_hookspecs.contexts`; which class: the kind's record in
:data:`~loongsage_hookspecs.KINDS`), ``args`` the job's ``*_args`` table. The host calls none of
them directly: every component a job names is bound through one function
(``ComponentRegistry.bind``), which checks and passes the arguments the same way for every kind.

Names are normalised (lower case, ``-`` becomes ``_``) so ``"Dr-GRPO"`` and ``"dr_grpo"`` are
the same component.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import attrs

from .capabilities import LoraTrainer, is_capability

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

    from .records import (
        AdvantageOutput,
        CorrectionOutput,
        PolicyLossOutput,
        Reward,
        TrajectoryGroup,
    )


def normalize_name(name: str) -> str:
    """Canonical component name: stripped, lower case, ``-`` replaced by ``_``."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"component name must be a non-empty string, got {name!r}")
    return name.strip().lower().replace("-", "_")


def _capability_list(_spec: Any, attribute: Any, value: tuple[type, ...]) -> None:
    bad = [c for c in value if not is_capability(c)]
    if bad:
        raise TypeError(f"{attribute.name}: {bad!r} are not capability protocols "
                        "(see loongsage_hookspecs.capabilities)")


def _import_path(_spec: Any, attribute: Any, value: str) -> None:
    module, _, name = value.partition(":") if isinstance(value, str) else ("", "", "")
    if not module or not name:
        raise TypeError(f"{attribute.name}: expected 'module:Name', got {value!r}")


def _attrs_class(_spec: Any, attribute: Any, value: type | None) -> None:
    if value is not None and not (isinstance(value, type) and attrs.has(value)):
        raise TypeError(f"{attribute.name}: expected an attrs class, got {value!r}")


@attrs.define(frozen=True, kw_only=True)
class ComponentSpec:
    """Fields every spec has: the selectable ``name``, a one-line ``description``, the optional
    ``capabilities`` its objects implement (protocols of :mod:`loongsage_hookspecs.capabilities`,
    checked when an object is built; only object-style kinds have any) and an optional
    ``args_schema``: an attrs class whose fields are the ``*_args`` the component takes (those
    without a default required). The host structures the job's table into it (keys, types and
    the fields' validators; ``loongsage validate`` does the same) and calls the component with
    every field of the result as a keyword. Without one, the callable's own signature is the
    schema: its keyword parameters (after the inputs or the context) are what a job may set, with
    their annotations as types and their defaults.

    ``args_from``: for a factory that passes its ``**args`` on to a class it imports when first
    called (so that listing components stays light), that class as ``"module:Name"``: its keyword
    parameters are the component's arguments, read (with their annotations) when a job is
    validated or bound, without building anything."""

    name: str = attrs.field(converter=normalize_name)
    description: str = ""
    capabilities: tuple[type, ...] = attrs.field(default=(), converter=tuple, validator=_capability_list)
    args_schema: type | None = attrs.field(default=None, validator=_attrs_class)
    args_from: str | None = attrs.field(default=None, validator=attrs.validators.optional(_import_path))

    def declared_capabilities(self) -> tuple[type, ...]:
        """Every capability the built object must implement (a kind may add implied ones)."""
        return self.capabilities

    def declares(self, capability: type) -> bool:
        """Whether objects of this spec implement ``capability``."""
        return capability in self.declared_capabilities()


@attrs.define(frozen=True, kw_only=True)
class RewardSpec(ComponentSpec):
    """``fn(trajectory, **args) -> float | Reward``; may raise, the host records the error.

    ``needs_sandbox``: the reward runs commands in the trajectory's sandbox (tests on the agent's
    edits); the host calls ``fn(trajectory, sandbox=sandbox, **args)`` before it destroys the
    sandbox (``sandbox`` is ``None`` when the source has none), in a worker thread.
    """

    fn: "Callable[..., float | Reward]"
    needs_sandbox: bool = False


@attrs.define(frozen=True, kw_only=True)
class AdvantageSpec(ComponentSpec):
    """``fn(inputs: AdvantageInputs, **args) -> AdvantageOutput``.

    ``needs_critic`` tells the host to train a value model and pass ``inputs.values``.
    ``group_relative``: the estimator compares the samples of one prompt with each other (GRPO,
    RLOO), so a group of one sample, or of identical greedy samples, gives no signal; the host
    refuses ``samples_per_prompt = 1`` and warns of ``temperature = 0`` for it.
    """

    fn: "Callable[..., AdvantageOutput]"
    needs_critic: bool = False
    group_relative: bool = False


@attrs.define(frozen=True, kw_only=True)
class PolicyLossSpec(ComponentSpec):
    """``fn(inputs: PolicyLossInputs, **args) -> PolicyLossOutput`` with a per-token loss."""

    fn: "Callable[..., PolicyLossOutput]"


@attrs.define(frozen=True, kw_only=True)
class KLSpec(ComponentSpec):
    """``fn(inputs: KLInputs, **args) -> torch.Tensor`` per-token KL ``[B, T]``.

    ``requires`` says which inputs must be filled: ``"logprobs"`` (sampled-token log-probs only),
    ``"topk"`` (reference top-k log-probs) or ``"logits"`` (full vocabulary on both sides).
    """

    fn: "Callable[..., torch.Tensor]"
    requires: str = attrs.field(default="logprobs",
                                validator=attrs.validators.in_(("logprobs", "topk", "logits")))


@attrs.define(frozen=True, kw_only=True)
class AggregationSpec(ComponentSpec):
    """``fn(loss [B, T], mask [B, T], norm: AggregationNorm, **args) -> scalar tensor``.

    Must divide by the global statistics in ``norm`` only, never by micro-batch statistics.
    """

    fn: "Callable[..., torch.Tensor]"


@attrs.define(frozen=True, kw_only=True)
class CorrectionSpec(ComponentSpec):
    """``fn(inputs: CorrectionInputs, **args) -> CorrectionOutput``.

    ``stage`` is ``"pre_advantage"`` (runs on old/rollout log-probs before advantages, e.g. M2PO)
    or ``"post_forward"`` (also sees the current log-probs, e.g. OPSM).
    """

    fn: "Callable[..., CorrectionOutput]"
    stage: str = attrs.field(default="pre_advantage",
                             validator=attrs.validators.in_(("pre_advantage", "post_forward")))


@attrs.define(frozen=True, kw_only=True)
class FilterSpec(ComponentSpec):
    """``fn(groups: list[TrajectoryGroup], **args) -> list[TrajectoryGroup]`` (the kept groups)."""

    fn: "Callable[..., Sequence[TrajectoryGroup]]"


@attrs.define(frozen=True, kw_only=True)
class DataSourceSpec(ComponentSpec):
    """``factory(ctx: BuildContext, **args) -> Iterable[dict]``: procedurally generated prompt rows.

    Each row is a mapping with at least ``prompt`` and ``label`` (and optionally ``metadata``);
    the rows must be deterministic for the same ``args`` (which include a ``seed``) so a resumed
    run sees the same data. A data source named by ``[[data]] generator`` in the job file uses it.
    """

    factory: "Callable[..., Any]"


@attrs.define(frozen=True, kw_only=True)
class AgentSpec(ComponentSpec):
    """``factory(ctx: BuildContext, **args) -> Agent`` (see :class:`~loongsage_hookspecs.protocols.Agent`).

    ``needs_sandbox`` asks the host to create a sandbox for every trajectory of this agent.
    ``fast_path`` declares a single-turn agent: it makes exactly one chat completion of the row's
    messages with the source's sampling and returns the reply, nothing else. The host may then
    generate its rows in batches straight at the engines instead of through the AgentFlow
    router, with the same tokens, log-probs and messages (only without router middleware,
    ``request_args`` or a sandbox, which need the router's path).
    ``check_args(**args)``, when given, is what ``loongsage validate`` runs on the data source's
    ``agent_args`` before anything starts (unknown arguments, a program that is not installed):
    it raises ``ValueError`` with a one-line reason, which the host reports with the job-file key.
    ``preflight(agent_args, sandbox, sandbox_args)``, when given, runs next: a quick trial start
    of the agent's program where its trajectories will run it (``sandbox``: the data source's
    ``[[data]] sandbox`` name or ``None``, ``sandbox_args`` its arguments), so a broken setup (a
    program the sandbox cannot see or run) is a ``ValueError`` with a one-line reason too.
    """

    factory: "Callable[..., Any]"
    needs_sandbox: bool = False
    check_args: "Callable[..., None] | None" = None
    preflight: "Callable[[dict[str, Any], str | None, dict[str, Any]], None] | None" = None
    fast_path: bool = False


@attrs.define(frozen=True, kw_only=True)
class SandboxSpec(ComponentSpec):
    """``factory(ctx: BuildContext, **args) -> SandboxProvider`` that creates and destroys
    per-trajectory sandboxes."""

    factory: "Callable[..., Any]"


@attrs.define(frozen=True, kw_only=True)
class RouterMiddlewareSpec(ComponentSpec):
    """``factory(ctx: BuildContext, **args) -> RouterMiddleware``; composed in job-file order
    around each request."""

    factory: "Callable[..., Any]"


@attrs.define(frozen=True, kw_only=True)
class SchedulerSpec(ComponentSpec):
    """``factory(ctx: SchedulerContext, **args) -> Scheduler`` deciding dispatch and collection in
    asynchronous mode (``ctx.batch_size``, ``ctx.stale_steps`` and, for a ``SourcePicker``,
    ``ctx.quota`` come from the job; ``args`` from ``[async] scheduler_args``)."""

    factory: "Callable[..., Any]"


@attrs.define(frozen=True, kw_only=True)
class TeacherSpec(ComponentSpec):
    """``factory(ctx: TeacherContext, **args) -> Teacher`` computing teacher log-probs over student
    samples (``ctx.path``: the ``[[teachers]]`` entry's model directory)."""

    factory: "Callable[..., Any]"


@attrs.define(frozen=True, kw_only=True)
class TeacherManagerSpec(ComponentSpec):
    """The policy that runs a step's rows through the run's teachers.

    ``factory(ctx: TeacherManagerContext, **args) -> TeacherRouter`` (see
    :class:`~loongsage_hookspecs.protocols.TeacherRouter`): ``ctx.teachers`` maps a teacher name to
    a ``Teacher``, ``ctx.routes`` a data source to a teacher name (``None``: not distilled),
    ``ctx.max_resident`` bounds the teachers loaded at once, ``ctx.source_key`` names the per-row
    ``batch.meta`` list of sources. ``metrics(inputs: KLInputs, *, input_ids) -> dict[str, float]``,
    when given, is logged each step over the distilled tokens (``inputs.ref_*`` hold the teacher's).
    """

    factory: "Callable[..., Any]"
    metrics: "Callable[..., dict[str, float]] | None" = None


@attrs.define(frozen=True, kw_only=True)
class WeightTransportSpec(ComponentSpec):
    """A way to move trainer weights into rollout engines.

    ``sender(ctx: WeightTransportContext, **args) -> WeightSender`` is built in the trainer
    process (``ctx.role == "sender"``); ``receiver(ctx: WeightTransportContext) -> WeightReceiver``
    inside the engine process (``ctx.role == "receiver"``), looked up by this spec's name (sent as the
    ``load_format`` of the engine's weight-update request). ``receiver = None`` marks a transport
    whose sender only speaks other transports' formats (one that picks a transport per engine).
    ``colocated_only``: the transport hands tensors over inside one process, so it needs
    ``[placement] colocate = true`` (``loongsage validate`` refuses it otherwise). A spec's
    ``capabilities`` are its sender's.

    ``auto_rank(target: WeightTarget) -> int | None``: how well this transport carries updates to
    one engine (:class:`~loongsage_hookspecs.WeightTarget`), higher first, or ``None`` where it
    cannot. The ``auto`` transport asks every active transport that has one and sends each
    engine's updates by the highest; a transport without ``auto_rank`` is never chosen by it.

    ``args_per_transport``: the transport's ``weight_transport_args`` are one table per transport
    it may choose (a transport that routes engines to others, like ``auto``); ``loongsage
    validate`` checks each key names an active transport with an ``auto_rank`` and each table
    against that transport's sender.
    """

    sender: "Callable[..., Any]"
    receiver: "Callable[..., Any] | None" = None
    colocated_only: bool = False
    auto_rank: "Callable[[Any], int | None] | None" = None
    args_per_transport: bool = False


@attrs.define(frozen=True, kw_only=True)
class EngineRouterSpec(ComponentSpec):
    """``factory(ctx: EngineRouterContext, **args) -> EngineRouter``: a load balancer the controller
    starts in front of the engines (``ctx.engine_urls``, which require ``ctx.api_key``); generation
    requests go through it, control calls do not.
    Optional ``add_engine(url)`` / ``remove_engine(url)`` let the controller replace an engine
    that died behind it."""

    factory: "Callable[..., Any]"


@attrs.define(frozen=True, kw_only=True)
class LoggerSpec(ComponentSpec):
    """``factory(ctx: LoggerContext, **args) -> MetricsLogger``; all listed loggers receive each
    step (``ctx.output_dir``: the run directory, ``ctx.total_steps`` the planned steps,
    ``ctx.start_step`` the step a resumed run starts from)."""

    factory: "Callable[..., Any]"


@attrs.define(frozen=True, kw_only=True)
class TrainBackendSpec(ComponentSpec):
    """``factory(ctx: TrainWorkerContext) -> TrainWorker``, called inside each trainer actor.

    A backend's settings are ``[train] backend_args``, read from ``ctx.job`` (the contract's
    :class:`~loongsage_hookspecs.TrainSettings`) rather than passed as keywords: they are checked
    as a whole with the job they must fit (the parallel layout against ``num_workers``, the
    model's ``config.json``, the devices of ``[placement]``) by ``check_job`` below, which
    ``loongsage validate`` runs.

    ``supports_lora``: the backend trains ``[train] lora`` adapters (its workers then yield the
    adapter alone from ``named_weights`` and score the KL reference with it disabled); a job with
    ``[train] lora`` on a backend without it is refused at validation. It implies the
    :class:`~loongsage_hookspecs.capabilities.LoraTrainer` capability.

    ``model_dtypes``: the ``[model] dtype`` values the backend trains in (empty: every one); a
    job with another dtype is refused at validation, with the reason, not when a worker starts.

    ``check_job(job) -> None``: the backend's own checks of a whole job (its ``[train]
    backend_args``, the model's ``config.json``, the parallel layout over ``[train] num_workers``
    ranks), run by ``loongsage validate`` and before ``loongsage run``; it raises ``ValueError``
    naming the key at fault. It runs where the job is validated, not on the trainer's machine,
    so it reads the trainer's devices from the job (``[placement] trainer_gpus``), never from
    the local hardware, and it must stay cheap (no model weights, no torch import needed).
    """

    factory: "Callable[..., Any]"
    supports_lora: bool = False
    model_dtypes: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    check_job: "Callable[[Any], None] | None" = None

    def declared_capabilities(self) -> tuple[type, ...]:
        extra = (LoraTrainer,) if self.supports_lora and LoraTrainer not in self.capabilities else ()
        return self.capabilities + extra


@attrs.define(frozen=True, kw_only=True)
class RolloutEngineSpec(ComponentSpec):
    """``factory(ctx: EngineContext) -> RolloutEngine``, called inside each engine actor; an
    engine reads its ``[rollout] engine_args`` from ``ctx.job`` (the contract's
    :class:`~loongsage_hookspecs.RolloutSettings`), as a backend reads its ``backend_args``.

    The engine serves SGLang's native HTTP API. ``supports_lora``: the engine applies LoRA adapter
    updates (:mod:`loongsage_hookspecs.lora`) and serves ``lora_path`` = ``LORA_ADAPTER_NAME``.

    ``check_job(job) -> None``: the engine's own checks of its ``[rollout] engine_args`` (unknown
    keys, bad values), run by ``loongsage validate`` and before ``loongsage run``; it raises
    ``ValueError`` naming the key at fault, and must stay cheap (no model, no torch import).
    """

    factory: "Callable[..., Any]"
    supports_lora: bool = False
    check_job: "Callable[[Any], None] | None" = None
