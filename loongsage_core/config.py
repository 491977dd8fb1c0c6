"""Job-file schema and loading.

A job file is TOML; its tables map onto the attrs classes below. Loading goes through cattrs
with unknown keys rejected and strict scalar types, and every problem is raised as a
:class:`ConfigError` that names the file, the dotted key and, for unknown keys, the closest
valid key. ``key=value`` overrides (dotted paths, ``data.0.weight=0.5`` for list entries) are
typed by the schema before they are applied.
"""

from __future__ import annotations

import difflib
import math
import sys
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


A = TypeVar("A", bound=attrs.AttrsInstance)
"""An attrs class (component ``*_args`` schemas are attrs classes)."""


class ConfigError(ValueError):
    """A job file or override is invalid; the message names the file and the key at fault."""


Args = dict[str, Any]


# --------------------------------------------------------------------------------------------
# Value ranges (attrs validators): a bad value fails at load time, naming its key
# --------------------------------------------------------------------------------------------

SEED_MAX = 2**31 - 1
"""Largest accepted seed: every consumer (Python, NumPy, torch, engines) takes it, plus ranks."""


class RangeError(ValueError):
    """A value outside its field's range; ``field`` names the attribute (joined to the key path)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(f"{field}: {message}")  # named when raised outside a job file (TrainConfig(...))
        self.message = message
        self.field = field


def _fmt(bound: float) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def _range(*, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None, finite: bool = True, optional: bool = False, extra: tuple[Any, ...] = ()) -> Any:
    """An attrs validator: a (finite) number within the given bounds (``extra`` values also pass)."""
    bounds = [f"{op} {_fmt(b)}" for op, b in ((">=", ge), (">", gt), ("<=", le), ("<", lt)) if b is not None]

    def check(_: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is None and optional:
            return
        if value in extra and not isinstance(value, bool):
            return
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
        if ok and finite:
            ok = math.isfinite(value)
        if ok:
            ok = ((ge is None or value >= ge) and (gt is None or value > gt)
                  and (le is None or value <= le) and (lt is None or value < lt))
        if not ok:
            integer = "int" in str(attribute.type) and "float" not in str(attribute.type)
            wanted = "an integer" if integer else ("a finite number" if finite else "a number")
            wanted = " ".join([wanted, " and ".join(bounds)]).strip()
            if extra:
                wanted += " (or " + ", ".join(repr(e) for e in extra) + ")"
            raise RangeError(f"must be {wanted}, got {value!r}", attribute.name)

    return check


def _betas(_: Any, attribute: attrs.Attribute, value: Any) -> None:
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(b, (int, float)) and math.isfinite(b) and 0 <= b < 1 for b in value)):
        raise RangeError(f"must be two numbers in [0, 1), e.g. [0.9, 0.999], got {value!r}", attribute.name)


_positive = _range(gt=0)
_non_negative = _range(ge=0)


def _custom_resources(_: Any, attribute: attrs.Attribute, value: Any) -> None:
    """A table of custom Ray resources: names other than CPU/GPU, non-negative finite amounts."""
    for name, amount in value.items():
        if name in ("CPU", "GPU"):
            raise RangeError(f"must not name {name!r} (use the *_{name.lower()}s keys), got {value!r}",
                             attribute.name)
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount) \
                or amount < 0:
            raise RangeError(f"must map resource names to finite numbers >= 0, got {name!r} = {amount!r}",
                             attribute.name)
_unit = _range(ge=0, le=1)
_count = _range(ge=1)
_seed = _range(ge=0, le=SEED_MAX)


@attrs.define
class PluginsConfig:
    """Which plugins are active: ``enable`` names distributions or entry points; ``modules``
    lists user hookimpl modules by file path (relative to the job file)."""

    enable: list[str] = attrs.field(factory=list)
    modules: list[str] = attrs.field(factory=list)


@attrs.define
class ModelConfig:
    """The policy model: a local Hugging Face directory (``path``) or, for tests and tiny models,
    a ``config`` table (a transformers config dict with ``model_type``) plus a ``tokenizer``
    directory or tokenizer.json file."""

    path: str | None = None
    config: Args = attrs.field(factory=dict)
    tokenizer: str | None = None
    dtype: str = attrs.field(default="float32", validator=attrs.validators.in_(("float32", "bfloat16", "float16")))
    fp32_lm_head: bool = False
    seed: int = attrs.field(default=0, validator=_seed)


LORA_ALL_LINEAR = "all-linear"
"""``[train] lora.target_modules`` value that targets every linear layer except the output layer."""


def _target_modules(_: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not value or not all(isinstance(v, str) and v for v in value):
        raise RangeError(f"must be \"{LORA_ALL_LINEAR}\" or a non-empty list of module names, got {value!r}",
                         attribute.name)
    if LORA_ALL_LINEAR in value and len(value) > 1:
        raise RangeError(f"\"{LORA_ALL_LINEAR}\" stands alone (it already names every linear layer), got {value!r}",
                         attribute.name)


@attrs.define
class LoraConfig:
    """``[train] lora``: train a low-rank adapter instead of the whole model (LoRA).

    ``rank`` is the adapter's rank r, ``alpha`` its scale (the update is ``alpha / rank * B @ A``),
    ``dropout`` the dropout on the adapter's input while training, ``target_modules`` the linear
    layers that get an adapter: module names (``["q_proj", "v_proj"]``) or ``"all-linear"`` (every
    linear layer but the output layer). Only the adapter's weights train, are checkpointed and are
    sent to the engines; the KL reference is the base model with the adapter disabled."""

    rank: int = attrs.field(default=8, validator=_count)
    alpha: float = attrs.field(default=16.0, validator=_positive)
    dropout: float = attrs.field(default=0.0, validator=_range(ge=0, lt=1))
    target_modules: list[str] = attrs.field(factory=lambda: [LORA_ALL_LINEAR], validator=_target_modules)

    @property
    def all_linear(self) -> bool:
        """Whether ``target_modules`` is ``"all-linear"``."""
        return self.target_modules == [LORA_ALL_LINEAR]


@attrs.define
class TrainConfig:
    """Trainer settings. ``mini_batch_size`` rows per optimizer step, split into micro-batches of
    ``micro_batch_size`` rows; the loss denominator is global to the mini-batch.

    ``max_bad_steps``: a step whose loss, gradient norm or weights are not finite is skipped, and so
    is one that trains no row; this many such steps in a row end the run with an error naming
    the cause.

    ``max_tokens_per_micro_batch``: padding-free micro-batches packed up to this many tokens
    (instead of ``micro_batch_size`` rows), for training and the scoring passes; data-parallel
    ranks then get near-equal token counts (backends without packing ignore it).

    ``peak_tflops``: one trainer device's peak the ``perf/mfu_*`` metrics divide by (default: a
    table of accelerators, or a matmul probe on a CPU; :mod:`loongsage_core.flops`).

    ``lora`` (a :class:`LoraConfig` table, unset by default): train a LoRA adapter instead of
    every weight."""

    backend: str = "torch"
    num_workers: int = attrs.field(default=1, validator=_count)
    lr: float = attrs.field(default=1e-5, validator=_positive)
    lr_schedule: str = attrs.field(default="constant", validator=attrs.validators.in_(("constant", "linear", "cosine")))
    lr_warmup_steps: int = attrs.field(default=0, validator=_range(ge=0))
    min_lr_ratio: float = attrs.field(default=0.0, validator=_unit)
    weight_decay: float = attrs.field(default=0.0, validator=_non_negative)
    betas: list[float] = attrs.field(factory=lambda: [0.9, 0.999], validator=_betas)
    eps: float = attrs.field(default=1e-8, validator=_positive)
    grad_clip: float = attrs.field(default=1.0, validator=_non_negative)
    total_steps: int = attrs.field(default=50, validator=_range(ge=0))
    mini_batch_size: int = attrs.field(default=16, validator=_count)
    micro_batch_size: int = attrs.field(default=4, validator=_count)
    max_tokens_per_micro_batch: int | None = attrs.field(default=None, validator=attrs.validators.optional(_count))
    ppo_epochs: int = attrs.field(default=1, validator=_count)
    max_bad_steps: int = attrs.field(default=3, validator=_count)
    gradient_checkpointing: bool = False
    peak_tflops: float | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))
    backend_args: Args = attrs.field(factory=dict)
    lora: LoraConfig | None = None


@attrs.define
class RolloutConfig:
    """Rollout settings: ``prompts_per_step`` prompts x ``samples_per_prompt`` samples each step.

    ``partial`` (asynchronous runs): at a weight update unfinished generations keep their tokens and
    continue under the new weights; ``partial_mask_stale`` then leaves the tokens an older policy
    generated out of the loss, training only on the part the newest policy wrote.

    ``engine_router`` (empty: none) names a load balancer started in front of the engines (the
    sglang plugin's ``sglang_router``); generation goes through it, weight updates and other
    control calls go to each engine."""

    engine: str = "torch"
    num_engines: int = attrs.field(default=1, validator=_count)
    prompts_per_step: int = attrs.field(default=8, validator=_count)
    samples_per_prompt: int = attrs.field(default=4, validator=_count)
    temperature: float = attrs.field(default=1.0, validator=_non_negative)
    top_p: float = attrs.field(default=1.0, validator=_range(gt=0, le=1))
    top_k: int = attrs.field(default=-1, validator=_range(ge=1, extra=(-1,)))
    max_new_tokens: int = attrs.field(default=64, validator=_count)
    max_context_length: int = attrs.field(default=2048, validator=_range(ge=2))
    partial: bool = False
    partial_mask_stale: bool = False
    weight_transport: str = "auto"
    weight_transport_args: Args = attrs.field(factory=dict)
    engine_args: Args = attrs.field(factory=dict)
    engine_router: str = ""
    engine_router_args: Args = attrs.field(factory=dict)


@attrs.define
class PlacementConfig:
    """Where actors live. ``colocate = true`` shares devices between trainer and engines;
    ``false`` gives each role its own pool (``*_cpus`` / ``*_gpus`` per actor).

    ``offload`` (colocated runs): the phases take turns on the shared devices. While the trainer
    trains, the engines release their memory (``kv_cache`` and ``weights``); before generation the
    trainer moves its weights, gradients and optimizer state to host memory and the engines take
    their memory back. ``false`` keeps both resident (enough memory for both, or CPU-only runs
    that want to skip the bookkeeping).

    ``trainer_resources`` / ``engine_resources``: custom Ray resources each trainer rank / engine
    actor reserves besides its CPUs and GPUs (e.g. ``{ train_node = 1 }``, a resource that
    ``ray start --resources`` gives one node only), which pins the role to the nodes that have them
    on a multi-node cluster. A colocated actor reserves the trainer's.

    Distillation teachers: at most ``max_resident_teachers`` are loaded at once (least recently
    used offloaded first; 0 offloads each right after its forward pass). ``teacher_offload``
    says what offloading does: ``"cpu"`` moves the weights off the accelerator (host memory
    keeps them, reloading is a copy), ``"release"`` frees the teacher entirely and rebuilds it
    from its ``path`` on next use (bounds host memory too, reloading reads the files).
    ``teacher_manager`` names the component (kind ``teacher_manager``) that routes rows to the
    teachers and applies that residency bound (``per_source``: the distill plugin's)."""

    colocate: bool = True
    offload: bool = True
    trainer_cpus: float = attrs.field(default=1.0, validator=_non_negative)
    engine_cpus: float = attrs.field(default=1.0, validator=_non_negative)
    trainer_gpus: float = attrs.field(default=0.0, validator=_non_negative)
    engine_gpus: float = attrs.field(default=0.0, validator=_non_negative)
    trainer_resources: dict[str, float] = attrs.field(factory=dict, validator=_custom_resources)
    engine_resources: dict[str, float] = attrs.field(factory=dict, validator=_custom_resources)
    max_resident_teachers: int = attrs.field(default=1, validator=attrs.validators.ge(0))
    teacher_offload: str = attrs.field(default="cpu", validator=attrs.validators.in_(("cpu", "release")))
    teacher_manager: str = "per_source"


@attrs.define
class AlgorithmConfig:
    """Loss pipeline choices (DESIGN.md section 6). Each ``*_args`` table is passed as keyword
    arguments to the named component.

    Distillation (rows of sources with a ``teacher``): with ``distill_kl`` unset the teachers
    stand in for the reference model and feed ``kl`` / ``kl_coef`` / ``kl_in_reward``; with
    ``distill_kl`` set (a ``kl`` component, e.g. ``opd_topk_kl``) it is a term of its own,
    ``distill_coef * aggregate(term)`` in the loss (or subtracted from the token rewards with
    ``distill_in_reward``), next to an ordinary reference KL. ``distill_topk`` is how many
    teacher top-k entries per token are computed when the term ``requires = "topk"``."""

    advantage: str = "grpo"
    advantage_args: Args = attrs.field(factory=dict)
    policy_loss: str = "ppo_clip"
    policy_loss_args: Args = attrs.field(factory=dict)
    loss_agg: str = "token_mean"
    loss_agg_args: Args = attrs.field(factory=dict)
    kl: str | None = None
    kl_args: Args = attrs.field(factory=dict)
    kl_coef: float = attrs.field(default=0.0, validator=_non_negative)
    kl_in_reward: bool = False
    ref_update_every: int = attrs.field(default=0, validator=_range(ge=0))
    entropy_coef: float = attrs.field(default=0.0, validator=_range())
    recompute_old_logprobs: bool = True
    force_old_logprob_pass: bool = False
    corrections: list[str] = attrs.field(factory=list)
    correction_args: dict[str, Args] = attrs.field(factory=dict)
    filters: list[str] = attrs.field(factory=list)
    filter_args: dict[str, Args] = attrs.field(factory=dict)
    max_filter_retries: int = attrs.field(default=0, validator=_range(ge=0))
    distill_kl: str | None = None
    distill_kl_args: Args = attrs.field(factory=dict)
    distill_coef: float = attrs.field(default=1.0, validator=_non_negative)
    distill_in_reward: bool = False
    distill_topk: int = attrs.field(default=20, validator=attrs.validators.ge(1))


_optional_positive = attrs.validators.optional(attrs.validators.ge(1))


@attrs.define
class CriticConfig:
    """The value model (critic) that advantage estimators with ``needs_critic`` (``gae``) use.

    It is the policy's transformer backbone plus a scalar value head, in Ray actors of its own,
    trained after the policy on each step's rows with a clipped value loss aggregated like the
    policy loss (``[algorithm] loss_agg``); it is checkpointed with the run. Unset values fall back
    to the policy's: ``path`` to ``[model] path`` (or the inline ``[model] config``), ``lr`` to
    ``[train] lr``, ``mini_batch_size`` / ``micro_batch_size`` / ``ppo_epochs`` to ``[train]``'s.
    ``value_clip`` bounds how far a value may move from its rollout-time value before the clipped
    term takes over (``0`` disables clipping); ``loss_coef`` scales the value loss. ``num_workers``
    data-parallel critic ranks reserve ``cpus`` / ``gpus`` each. Jobs whose advantage needs no
    critic ignore this table."""

    path: str | None = None
    lr: float | None = attrs.field(default=None, validator=_range(gt=0, optional=True))
    value_clip: float = attrs.field(default=0.2, validator=_non_negative)
    loss_coef: float = attrs.field(default=1.0, validator=_positive)
    mini_batch_size: int | None = attrs.field(default=None, validator=_optional_positive)
    micro_batch_size: int | None = attrs.field(default=None, validator=_optional_positive)
    ppo_epochs: int | None = attrs.field(default=None, validator=_optional_positive)
    num_workers: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    cpus: float = attrs.field(default=1.0, validator=_non_negative)
    gpus: float = attrs.field(default=0.0, validator=_non_negative)


@attrs.define
class DataConfig:
    """One data source. Either ``path`` (a JSONL file, a parquet file, or a directory written by
    ``datasets``' ``save_to_disk``; ``split`` picks one split of a saved ``DatasetDict``) or
    ``generator`` (a procedural task from a plugin) gives the prompts; ``agent``, ``reward`` and
    sampling are per source."""

    name: str = "default"
    path: str | None = None
    generator: str | None = None
    generator_args: Args = attrs.field(factory=dict)
    weight: float = attrs.field(default=1.0, validator=_positive)
    split: str | None = None
    prompt_key: str = "prompt"
    label_key: str = "label"
    metadata_key: str | None = None
    system_prompt: str | None = None
    agent: str = "single_turn"
    agent_args: Args = attrs.field(factory=dict)
    sandbox: str | None = None
    sandbox_args: Args = attrs.field(factory=dict)
    reward: list[str] = attrs.field(factory=lambda: ["exact_match"])
    reward_args: dict[str, Args] = attrs.field(factory=dict)
    reward_timeout_s: float = attrs.field(default=300.0, validator=_positive)
    teacher: str | None = None
    sampling: Args = attrs.field(factory=dict)
    shuffle: bool = True


@attrs.define
class AgentFlowConfig:
    """The AgentFlow router: middleware in the listed order, per-trajectory budgets, agent limits.

    ``access_log``: a JSON-lines file that gets one line per router request (method, path,
    status, milliseconds); empty: the log is kept in memory only (``GET /admin/access_log``).
    """

    middleware: list[str] = attrs.field(factory=list)
    middleware_args: dict[str, Args] = attrs.field(factory=dict)
    max_response_tokens: int = attrs.field(default=0, validator=_range(ge=0))
    agent_timeout_s: float = attrs.field(default=600.0, validator=_positive)
    max_concurrent_agents: int = attrs.field(default=64, validator=_count)
    port: int = attrs.field(default=0, validator=_range(ge=0, le=65535))
    # requests bigger than this get a 413, conversations with more text a 400, before tokenizing
    max_request_bytes: int = attrs.field(default=8 * 1024 * 1024, validator=_count)
    max_prompt_chars: int = attrs.field(default=1_000_000, validator=_count)
    access_log: str = ""  # a file the router appends its access log to (JSON lines); "" keeps it in memory


@attrs.define
class AsyncConfig:
    """Asynchronous training: a scheduler bounds staleness to ``stale_steps`` policy versions."""

    enable: bool = False
    scheduler: str = "windowed_fifo"
    scheduler_args: Args = attrs.field(factory=dict)
    stale_steps: int = attrs.field(default=1, validator=_range(ge=0))


@attrs.define
class LoggerConfig:
    """One metrics logger, by component name, with its arguments."""

    name: str
    args: Args = attrs.field(factory=dict)


@attrs.define
class TeacherConfig:
    """A distillation teacher: a name data sources refer to, a model and a teacher backend."""

    name: str
    path: str | None = None
    backend: str = "torch"
    args: Args = attrs.field(factory=dict)


@attrs.define
class RunConfig:
    """Run-level settings: seed, checkpoints, resume and the local Ray cluster.

    ``seed`` is in ``[0, 2**31 - 1]``. A run directory that already holds a run is continued with
    ``resume = true`` (from the newest intact checkpoint) and otherwise refused, unless the CLI's
    ``--overwrite`` moves the old run aside. ``keep_checkpoints = 0`` keeps every checkpoint."""

    seed: int = attrs.field(default=0, validator=_seed)
    output_dir: str = "runs/default"
    resume: bool = False
    checkpoint_every: int = attrs.field(default=0, validator=_range(ge=0))
    keep_checkpoints: int = attrs.field(default=2, validator=_range(ge=0))
    save_hf_at_end: bool = True
    ray_address: str | None = None
    ray_num_cpus: int | None = attrs.field(default=None, validator=_range(ge=1, optional=True))
    ray_object_store_mb: int = attrs.field(default=256, validator=_count)
    ray_dashboard: bool = False  # the Ray dashboard (loopback only) of a local cluster
    # rollout records (docs/records.md): -1 every trajectory of each step, 0 none, N a sample of N
    rollout_records: int = attrs.field(default=-1, validator=_range(ge=-1))


@attrs.define
class SftConfig:
    """Supervised fine-tuning (``loongsage sft``): how the ``[[data]]`` conversations become steps.

    Each row's ``messages_key`` column holds a chat (a list of ``{"role", "content"}`` messages,
    optionally with ``tool_calls``; ``tools_key`` may name a column of tool schemas). It is rendered
    with the model's chat template by the AgentFlow router's own code, and the loss is on the
    assistant turns only (``loss_on = "assistant"``) or on every token after the first (``"all"``).
    A step trains ``[train] mini_batch_size`` conversations; ``packing`` lays a step's
    conversations into rows of at most ``max_seq_len`` tokens, each attending only to itself with
    restarting position ids, which gives the same loss as one row per conversation. Conversations
    longer than ``max_seq_len`` are cut to it. ``eval_rows`` (a count) or ``eval_fraction`` of the
    rows are held back and their loss is reported as ``sft/eval_loss`` every ``eval_every`` steps
    (0: at the end only). The run trains ``epochs`` passes over the rest (``max_steps`` > 0 stops
    earlier); ``[train] total_steps`` is not used."""

    epochs: int = attrs.field(default=1, validator=_count)
    max_steps: int = attrs.field(default=0, validator=_range(ge=0))
    packing: bool = True
    max_seq_len: int = attrs.field(default=2048, validator=_range(ge=2))
    loss_on: str = attrs.field(default="assistant", validator=attrs.validators.in_(("assistant", "all")))
    messages_key: str = "messages"
    tools_key: str | None = None
    eval_rows: int = attrs.field(default=0, validator=_range(ge=0))
    eval_fraction: float = attrs.field(default=0.0, validator=_range(ge=0, lt=1))
    eval_every: int = attrs.field(default=0, validator=_range(ge=0))
    shuffle: bool = True


@attrs.define
class JobConfig:
    """A whole job file. TOML table ``[async]`` maps to :attr:`async_`."""

    plugins: PluginsConfig = attrs.field(factory=PluginsConfig)
    model: ModelConfig = attrs.field(factory=ModelConfig)
    train: TrainConfig = attrs.field(factory=TrainConfig)
    rollout: RolloutConfig = attrs.field(factory=RolloutConfig)
    placement: PlacementConfig = attrs.field(factory=PlacementConfig)
    algorithm: AlgorithmConfig = attrs.field(factory=AlgorithmConfig)
    data: list[DataConfig] = attrs.field(factory=list)
    agentflow: AgentFlowConfig = attrs.field(factory=AgentFlowConfig)
    async_: AsyncConfig = attrs.field(factory=AsyncConfig, alias="async_")
    loggers: list[LoggerConfig] = attrs.field(factory=lambda: [LoggerConfig(name="console")])
    teachers: list[TeacherConfig] = attrs.field(factory=list)
    critic: CriticConfig = attrs.field(factory=CriticConfig)
    run: RunConfig = attrs.field(factory=RunConfig)
    sft: SftConfig | None = None  # set by an [sft] table: a supervised job for ``loongsage sft``
    source_path: str | None = attrs.field(default=None, metadata={"internal": True})

    @property
    def base_dir(self) -> Path:
        """Directory relative paths in the job file are resolved against."""
        return Path(self.source_path).resolve().parent if self.source_path else Path.cwd()

    def resolve_path(self, value: str) -> str:
        """``value`` as an absolute path, relative ones taken from the job file's directory."""
        p = Path(value).expanduser()
        return str(p if p.is_absolute() else (self.base_dir / p).resolve())

    def data_where(self, index: int) -> str:
        """How errors name data source ``index``: ``<job file>: data[i] ('name')``."""
        return f"{self.source_path or '<job>'}: data[{index}] ('{self.data[index].name}')"


TOML_RENAMES = {"async": "async_"}
"""TOML keys that are Python keywords, and the attribute they fill."""


# --------------------------------------------------------------------------------------------
# Strict structuring
# --------------------------------------------------------------------------------------------


def _strict(expected: type) -> Any:
    def structure(value: Any, _: Any) -> Any:
        ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise TypeError(f"expected {expected.__name__}, got {type(value).__name__} {value!r}")
        return value

    return structure


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    for t in (int, float, bool, str):
        conv.register_structure_hook(t, _strict(t))

    def structure_args(value: Any, _: Any) -> Args:
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a table, got {type(value).__name__} {value!r}")
        return dict(value)

    conv.register_structure_hook_func(lambda t: t == Args, structure_args)

    def structure_name_list(value: Any, _: Any) -> list[str]:
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise TypeError(f"expected a name or a list of names, got {value!r}")

    conv.register_structure_hook_func(lambda t: t == list[str], structure_name_list)
    return conv


_CONVERTER = _make_converter()


def _rename_keys(raw: Any) -> Any:
    if isinstance(raw, dict):
        return {TOML_RENAMES.get(k, k): v for k, v in raw.items()}
    return raw


def _field_names(cls: type) -> list[str]:
    return [f.name for f in attrs.fields(cls) if not f.metadata.get("internal")]


def _toml_name(name: str) -> str:
    inverse = {v: k for k, v in TOML_RENAMES.items()}
    return inverse.get(name, name)


def _check_keys(raw: Any, cls: type, path: str, where: str) -> None:
    """Reject unknown keys anywhere in ``raw`` with the dotted key and a did-you-mean hint."""
    if not isinstance(raw, dict):
        return
    names = _field_names(cls)
    hints = typing.get_type_hints(cls)
    for key, value in raw.items():
        attr = TOML_RENAMES.get(key, key)
        dotted = f"{path}.{key}" if path else key
        if attr not in names:
            valid = [_toml_name(n) for n in names]
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean '{(path + '.') if path else ''}{close[0]}'?)" if close else ""
            raise ConfigError(f"{where}: unknown key '{dotted}'{hint}; valid keys here: {', '.join(valid)}")
        sub = _attrs_class_of(hints[attr])
        if sub is not None:
            if typing.get_origin(hints[attr]) is list:
                if isinstance(value, list):
                    for i, item in enumerate(value):
                        _check_keys(item, sub, f"{dotted}[{i}]", where)
            else:
                _check_keys(value, sub, dotted, where)


def _attrs_class_of(tp: Any) -> type | None:
    """The attrs class inside ``tp`` (``X``, ``list[X]`` or ``X | None``), if any."""
    if attrs.has(tp):
        return tp
    for arg in typing.get_args(tp):
        if attrs.has(arg):
            return arg
    return None


def _describe_errors(exc: BaseException, where: str) -> ConfigError:
    messages = cattrs.transform_error(exc, path="$", format_exception=_format_exception)
    first = messages[0] if messages else str(exc)
    return ConfigError(f"{where}: {first}")


_FIELD_MARK = "\x00"


def _format_exception(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, RangeError):
        return f"{exc.message}{_FIELD_MARK}{exc.field}"  # the field joins the key path (see _tidy_path)
    if isinstance(exc, KeyError):
        return "required key is missing"
    if isinstance(exc, ValueError) and len(exc.args) >= 2 and isinstance(exc.args[1], attrs.Attribute):
        return f"{exc.args[0]} for '{exc.args[1].name}'"  # attrs validator failure
    if isinstance(exc, ForbiddenExtraKeysError):
        return f"unknown keys {sorted(exc.extra_fields)}"
    return str(exc) if str(exc) else type(exc).__name__


def _tidy_path(message: str) -> str:
    # cattrs writes paths as $.train.lr / $.data[0].weight; show them as dotted keys
    if _FIELD_MARK in message:  # a validator's field: "msg\0lr @ $.train" -> "msg @ $.train.lr"
        text, _, rest = message.partition(_FIELD_MARK)
        field, _, path = rest.partition(" @ ")
        message = f"{text} @ {path}.{field}" if path != "$" else f"{text} @ $.{field}"
    return message.replace("@ $.", "at key '").replace("@ $", "at the top level")


def structure_job(raw: Mapping[str, Any], source: str | None = None) -> JobConfig:
    """Build a :class:`JobConfig` from a parsed TOML mapping, with errors naming ``source``."""
    where = source or "<job>"
    raw = _rename_keys(dict(raw))
    _check_keys(raw, JobConfig, "", where)
    try:
        job = _CONVERTER.structure(raw, JobConfig)
    except (ClassValidationError, IterableValidationError) as exc:
        err = _describe_errors(exc, where)
        msg = _tidy_path(str(err))
        if "at key '" in msg:
            msg += "'"
        raise ConfigError(msg.replace("async_", "async")) from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    job.source_path = source
    return job


def load_job(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    """Read a TOML job file, apply ``key=value`` overrides, and structure it."""
    path = Path(path)
    where = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{where}: job file not found") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 text (byte {exc.start}: {exc.reason}); "
                          "job files are UTF-8 TOML") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read job file: {exc.strerror or exc}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: malformed TOML: {exc}") from None
    for item in overrides:
        apply_override(raw, item, where)
    return structure_job(raw, str(path))


def structure_args(cls: type[A], args: Mapping[str, Any], key: str, owner: str) -> A:
    """A component's ``*_args`` table (e.g. ``[train] backend_args``) as the attrs class ``cls``.

    Unknown keys and invalid values raise ``ValueError`` naming ``key`` and, for unknown keys, the
    ``owner`` component and its valid keys.
    """
    valid = [f.name for f in attrs.fields(cls)]
    unknown = sorted(set(args) - set(valid))
    if unknown:
        raise ValueError(f"{key}: unknown keys {unknown} for the {owner}; valid keys: {', '.join(valid)}")
    try:
        return cls(**args)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{key}: {exc}") from None


# --------------------------------------------------------------------------------------------
# key=value overrides
# --------------------------------------------------------------------------------------------


def _parse_dotted(key: str) -> list[str]:
    return [part for part in key.replace("[", ".").replace("]", "").split(".") if part]


def _type_at(parts: Sequence[str], where: str, original: str) -> Any:
    """The schema type at a dotted path, or raise naming the unknown part."""
    tp: Any = JobConfig
    walked: list[str] = []
    for part in parts:
        cls = _attrs_class_of(tp) if not (typing.get_origin(tp) is list and part.isdigit()) else None
        if typing.get_origin(tp) is list and part.isdigit():
            tp = typing.get_args(tp)[0]
        elif cls is not None:
            attr = TOML_RENAMES.get(part, part)
            hints = typing.get_type_hints(cls)
            if attr not in _field_names(cls):
                valid = [_toml_name(n) for n in _field_names(cls)]
                close = difflib.get_close_matches(part, valid, n=1)
                hint = f" (did you mean '{'.'.join(walked + [close[0]])}'?)" if close else ""
                raise ConfigError(f"{where}: override '{original}': unknown key '{'.'.join(walked + [part])}'{hint}")
            tp = hints[attr]
        elif _is_table_type(tp):
            return Any  # inside a free-form table (``*_args``)
        else:
            name = getattr(tp, "__name__", str(tp))
            raise ConfigError(f"{where}: override '{original}': '{'.'.join(walked)}' is a {name}, not a table, "
                              f"so it has no key '{part}'")
        walked.append(part)
    return tp


def _is_table_type(tp: Any) -> bool:
    """Whether ``tp`` is a free-form table (``Args``, ``dict[...]``) or unknown (``Any``)."""
    return tp is Any or tp is dict or typing.get_origin(tp) is dict


def _parse_value(text: str, tp: Any) -> Any:
    if tp is str or tp == (str | None):
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(raw: dict[str, Any], item: str, where: str = "<overrides>") -> None:
    """Apply one ``dotted.key=value`` override to the raw TOML mapping, typed by the schema."""
    if "=" not in item:
        raise ConfigError(f"{where}: override '{item}' is not of the form key=value")
    key, _, text = item.partition("=")
    parts = _parse_dotted(key.strip())
    if not parts:
        raise ConfigError(f"{where}: override '{item}' has an empty key")
    tp = _type_at(parts, where, item)
    value = _parse_value(text.strip(), tp)
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(node, list):
            if not part.isdigit():
                raise ConfigError(f"{where}: override '{item}': '{'.'.join(parts[:i])}' is a list; "
                                  f"use an index, not '{part}'")
            idx = int(part)
            while len(node) <= idx:
                node.append({})
            node = node[idx]
        elif isinstance(node, dict):
            node = node.setdefault(part, [] if nxt.isdigit() else {})
        else:
            raise ConfigError(f"{where}: override '{item}': '{'.'.join(parts[:i])}' is "
                              f"{type(node).__name__} {node!r}, not a table, so it has no key '{part}'")
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"{where}: override '{item}': '{'.'.join(parts[:i + 1])}' is "
                              f"{type(node).__name__} {node!r}, not a table, so it has no key '{nxt}'")
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit():
            raise ConfigError(f"{where}: override '{item}': '{'.'.join(parts[:-1])}' is a list; "
                              f"use an index, not '{last}'")
        idx = int(last)
        while len(node) <= idx:
            node.append({})
        node[idx] = merge_tables(node[idx], value)
    else:
        node[last] = merge_tables(node.get(last), value)


def merge_tables(old: Any, new: Any) -> Any:
    """``new`` laid over ``old``: tables merge key by key (recursively), anything else replaces.

    So ``train={lr=1}`` changes ``train.lr`` and keeps the rest of ``[train]``.
    """
    if isinstance(old, dict) and isinstance(new, dict):
        merged = dict(old)
        for key, value in new.items():
            merged[key] = merge_tables(old.get(key), value)
        return merged
    return new


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def job_to_dict(job: JobConfig) -> dict[str, Any]:
    """The job as plain TOML-ready data (``None`` values dropped, ``async_`` written ``async``)."""
    data = _CONVERTER.unstructure(job)
    data.pop("source_path", None)
    data["async"] = data.pop("async_")
    return _drop_none(data)


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def dump_job_toml(job: JobConfig) -> str:
    """The resolved job as TOML text (what ``config.resolved.toml`` holds)."""
    import tomli_w

    return tomli_w.dumps(job_to_dict(job))
