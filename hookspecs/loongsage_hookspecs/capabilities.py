"""Optional capabilities of components: small protocols a spec declares.

The protocols of :mod:`loongsage_hookspecs.protocols` list what every component of a kind must
have. Some components can do more: a train worker that moves its state off the accelerator, a
logger that rewrites history after a resume, an engine router that takes a replacement engine.
Each such extra is one protocol below. A component declares the ones it has in its spec::

    TrainBackendSpec(name="mine", factory=make_worker, capabilities=(Offloadable, ModelParallel))

and the host then relies on them:

* when the component is built, the object must implement every declared capability (a missing
  method is a build error naming it, not an ``AttributeError`` hours into a run);
* when a job needs a capability (several data sources under an asynchronous scheduler need a
  :class:`SourcePicker`), ``loongsage validate`` refuses a component that does not declare it,
  naming the job-file key;
* at run time the host calls a capability's methods only on objects that implement its protocol
  (``isinstance(obj, Offloadable)``), never by probing attribute names.

A component that does not declare a capability is used without it: nothing is offloaded, the
logger's old lines stay, and so on (each protocol says what happens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

    from .records import Batch
    from .settings import LoraSettings


@runtime_checkable
class Offloadable(Protocol):
    """A train worker (or teacher) that frees the accelerator between uses.

    The host calls ``offload()`` while colocated engines generate and ``onload()`` before the
    worker trains again. Without it the worker's state stays where it is.
    """

    def offload(self) -> None: ...

    def onload(self) -> None: ...


@runtime_checkable
class ModelParallel(Protocol):
    """A train worker whose model spans several ranks (tensor/pipeline/expert parallelism).

    The controller splits rows over ``data_parallel_size`` replicas and gives every rank of one
    replica the same rows. Without it each rank is its own replica.
    """

    @property
    def data_parallel_rank(self) -> int: ...

    @property
    def data_parallel_size(self) -> int: ...


@runtime_checkable
class LoraTrainer(Protocol):
    """A train worker of a backend whose spec sets ``supports_lora``: it trains a ``[train] lora``
    adapter, scores the KL reference with the adapter disabled and saves the adapter alone.

    ``serves_reference`` true means no separate reference worker is built for the KL term.
    """

    @property
    def serves_reference(self) -> bool: ...

    def reference_forward(self, batch: "Batch") -> dict[str, "torch.Tensor"]: ...

    def save_adapter(self, path: str) -> None: ...


@runtime_checkable
class StepwiseTraining(Protocol):
    """A train worker whose step a caller drives in parts, as a training API does (the
    Tinker-compatible service): the gradients of several ``accumulate_gradients`` calls add up,
    each under the loss ``pipeline`` the caller gives (a ``LossPipeline``; ``None``: the job's);
    ``optimizer_step`` then takes one step with the caller's ``hyperparameters`` (any of ``lr``,
    ``beta1``, ``beta2``, ``eps``, ``weight_decay``, ``grad_clip``; the rest as configured);
    ``reset_optimizer_state`` forgets the optimizer's moments (weights loaded without them).
    A backend without it cannot serve such a service (refused when a model is created)."""

    def accumulate_gradients(self, batch: "Batch", norm: Any, *, pipeline: Any = None) -> dict[str, float]: ...

    def optimizer_step(self, *, hyperparameters: Mapping[str, float] | None = None) -> dict[str, float]: ...

    def reset_optimizer_state(self) -> None: ...


@runtime_checkable
class ReusesTrainingLogprobs(Protocol):
    """A train worker that keeps the detached log-probs its first training pass computed.

    When the step's old log-probs are the policy's current ones (one mini-batch, one epoch), the
    host skips the separate forward pass and reads ``training_forward_logprobs`` (``None`` when
    the last mini-batch's were not the old ones).
    """

    @property
    def training_forward_logprobs(self) -> "torch.Tensor | None": ...


@runtime_checkable
class SharesPrompts(Protocol):
    """A train worker that may run the prompt of the rows of a group once rather than once a row
    (``share_prompts`` says whether it does): the ``perf/mfu_*`` metrics then count each group's
    prompt once, the FLOPs it spent, not those of the rows as given."""

    @property
    def share_prompts(self) -> bool: ...


@runtime_checkable
class OnDevice(Protocol):
    """A train worker that says which device it computes on (for the ``perf/mfu_*`` metrics'
    peak FLOP/s). Without it the host assumes the CPU."""

    @property
    def device(self) -> "torch.device | str": ...


@runtime_checkable
class LoadsWeights(Protocol):
    """A train worker whose weights can be replaced from named tensors (``[algorithm]
    ref_update_every`` copies the policy into the frozen reference this way)."""

    def load_weights(self, weights: Iterable[tuple[str, "torch.Tensor"]]) -> None: ...


@runtime_checkable
class Closeable(Protocol):
    """A component holding resources (threads, processes, files) that ``close()`` releases at the
    end of the run. Without it nothing is called."""

    def close(self) -> Any: ...


@runtime_checkable
class ReportsIsolation(Protocol):
    """A sandbox provider that says what it enforces on this machine: ``enforced["isolation"]``
    (e.g. ``bwrap``, ``netns``, ``none``) and ``enforced["warnings"]`` (each weaker-than-asked
    setting in words). The host copies both into each trajectory's ``metadata["sandbox"]``."""

    @property
    def enforced(self) -> Mapping[str, Any]: ...


@runtime_checkable
class RunsPrograms(Protocol):
    """A sandbox (what a provider's ``create`` returns) that runs an agent's program inside itself:
    its isolation, limits and user, with the router reachable through ``bridge`` where the sandbox
    has no network. ``arun_program(argv, *, env, stdin, timeout_s, bridge, max_output_bytes,
    budgeted, read_only)`` returns the finished program's exit code, output and ``timed_out``
    (``read_only``: host paths the program needs, visible read-only inside). Agents that
    run programs (``command``, the CLI agents) use it; without it they run the program on the host
    in a scratch directory."""

    async def arun_program(self, argv: list[str], **options: Any) -> Any: ...


@runtime_checkable
class ResidentTeacher(Protocol):
    """A teacher that is loaded onto its device when it is about to score and offloaded after,
    so several teachers can take turns within ``placement.max_resident_teachers``."""

    def load(self) -> None: ...

    def offload(self) -> None: ...


@runtime_checkable
class StepTruncation(Protocol):
    """A logger that forgets the steps after ``step`` when a run resumes from that step's
    checkpoint (the resumed run logs them again). Without it, redone steps appear twice."""

    def truncate_after(self, step: int) -> Any: ...


@runtime_checkable
class TrajectoryLogger(Protocol):
    """A logger that also receives each step's rollout records (the same dicts as
    ``rollouts/step_*.jsonl``), when ``wants_trajectories`` is true."""

    @property
    def wants_trajectories(self) -> bool: ...

    def log_trajectories(self, step: int, records: Sequence[Mapping[str, Any]]) -> None: ...


@runtime_checkable
class ReplaceableEngines(Protocol):
    """An engine router that is told when the controller replaces an engine that died behind it;
    both calls block until it routes accordingly. Without it, an engine death behind the router
    ends the run."""

    def add_engine(self, url: str) -> None: ...

    def remove_engine(self, url: str) -> None: ...


@runtime_checkable
class LoraAwareSender(Protocol):
    """A weight sender that must know a LoRA run's adapter settings (to write adapter directories
    for its engines); the host calls ``configure_lora`` once, before the first ``send``."""

    def configure_lora(self, settings: "LoraSettings") -> None: ...


@runtime_checkable
class SourcePicker(Protocol):
    """An asynchronous scheduler that keeps the shares of several data sources.

    Its factory's context (``SchedulerContext``) carries ``quota``: a callable
    ``version -> {source: prompts}`` (the ``[[data]]`` weights apportioned over
    ``rollout.prompts_per_step``), and ``next_source(version)`` names the source of each
    dispatch. A job with more than one data source needs it.
    """

    def next_source(self, trainer_version: int) -> str | None: ...


@runtime_checkable
class DeadlineScheduler(Protocol):
    """An asynchronous scheduler that gives each live group a deadline: ``deadline_of(group_id)``
    is the last trainer version allowed to train it (``None``: it has none, its tokens alone
    decide). The host sends minus the deadline as the group's engine ``priority`` (larger runs
    sooner: earliest deadline first); without this capability, or for a group without a
    deadline, minus the version the group was dispatched at."""

    def deadline_of(self, group_id: str) -> int | None: ...


@runtime_checkable
class StreamingMiddleware(Protocol):
    """A router middleware that can rewrite a response while it streams: ``stream_holdback``
    says how many trailing characters of ``text`` to hold back (a tool call or a reasoning block
    may be starting). Without it, a stream through this middleware sends its text at the end."""

    def stream_holdback(self, request: dict[str, Any], text: str) -> int: ...


@runtime_checkable
class ObservingMiddleware(Protocol):
    """A router middleware that never changes a response (a logger), saying so with
    ``changes_response = False``. Streaming leaves it out of a turn's partial views (its
    ``on_response`` sees only the final response) and does not wait for it. Without it, a
    middleware that is not a ``StreamingMiddleware`` holds a stream's text until the turn ends."""

    @property
    def changes_response(self) -> bool: ...


@runtime_checkable
class ConstrainsToolCalls(Protocol):
    """A router middleware that knows how the model writes a tool call, so the router can force
    one (``tool_choice`` ``required`` or a named function) by grammar-constrained decoding.

    ``tool_call_syntax(request)`` returns ``(begin, end, separator, arguments_key)`` for the
    request (a chat-completions body): a call is written ``begin + JSON + end`` where the JSON
    object holds ``"name"`` and ``arguments_key`` (e.g. hermes: ``("<tool_call>\\n",
    "\\n</tool_call>", "\\n", "arguments")``), several calls are joined by ``separator`` (empty:
    one call per answer); or
    ``None`` when it cannot say. Without a middleware that does, a forced call is a 400."""

    def tool_call_syntax(self, request: dict[str, Any]) -> tuple[str, str, str, str] | None: ...


def is_capability(obj: Any) -> bool:
    """Whether ``obj`` can be declared in a spec's ``capabilities``: a runtime-checkable protocol."""
    return isinstance(obj, type) and bool(getattr(obj, "_is_runtime_protocol", False))


def missing_members(obj: Any, capability: type) -> list[str]:
    """The members of ``capability`` that ``obj`` lacks (empty: it implements it)."""
    members = sorted(getattr(capability, "__protocol_attrs__", None)
                     or {n for n in vars(capability) if not n.startswith("_")})
    return [name for name in members if not hasattr(obj, name)]
