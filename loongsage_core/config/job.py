"""The whole job file (:class:`JobConfig`) and its run-level tables.

``[plugins]`` (which plugins are active), ``[placement]`` (where actors live), ``[[loggers]]``
(metrics loggers) and ``[run]`` (seed, checkpoints, the Ray cluster) are declared here;
:class:`JobConfig` gathers them with the training tables (:mod:`.training`) and the rollout
tables (:mod:`.rollout`). The section classes are imported at module level, not for typing only:
the structuring step resolves these annotations with ``typing.get_type_hints``.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from .evaluation import EvalConfig
from .fields import Args, at_least_one, component, custom_resources, in_range, non_negative, valid_seed
from .rollout import AgentFlowConfig, AsyncConfig, DataConfig, RolloutConfig
from .training import AlgorithmConfig, CriticConfig, ModelConfig, SftConfig, TeacherConfig, TrainConfig


@attrs.define
class PluginsConfig:
    """Which plugins are active: ``enable`` names distributions or entry points; ``modules``
    lists user hookimpl modules by file path (relative to the job file)."""

    enable: list[str] = attrs.field(factory=list)
    """Plugins to activate, by distribution name (``loongsage-plugin-rl``) or entry-point name (``rl``); empty:
    every installed plugin."""
    modules: list[str] = attrs.field(factory=list)
    """User hookimpl modules by file path (relative to the job file), loaded beside the installed plugins."""


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
    teachers and applies that residency bound (``per_source``: the distill plugin's). The teachers
    live in one actor of their own in the run's placement group, which reserves ``teacher_cpus``
    / ``teacher_gpus`` (and the custom ``teacher_resources``) for it."""

    colocate: bool = True
    """``true``: trainer rank *i* and engine *i* share one actor and its devices; ``false``: each has an actor of
    its own."""
    offload: bool = True
    """Colocated runs: trainer and engines take turns on the shared devices (engines release their memory while the
    trainer trains, the trainer offloads while they generate)."""
    trainer_cpus: float = attrs.field(default=1.0, validator=non_negative)
    """CPUs each trainer rank's actor reserves."""
    engine_cpus: float = attrs.field(default=1.0, validator=non_negative)
    """CPUs each engine actor reserves (non-colocated runs)."""
    trainer_gpus: float = attrs.field(default=0.0, validator=non_negative)
    """GPUs each trainer rank's actor reserves."""
    engine_gpus: float = attrs.field(default=0.0, validator=non_negative)
    """GPUs each engine actor reserves (non-colocated runs)."""
    trainer_resources: dict[str, float] = attrs.field(factory=dict, validator=custom_resources)
    """Custom Ray resources each trainer rank reserves (e.g. ``{ train_node = 1 }``), to pin it to the nodes that
    have them."""
    engine_resources: dict[str, float] = attrs.field(factory=dict, validator=custom_resources)
    """Custom Ray resources each engine actor reserves, to pin engines to the nodes that have them."""
    max_resident_teachers: int = attrs.field(default=1, validator=attrs.validators.ge(0))
    """Distillation teachers loaded at once (least recently used offloaded first; 0: each offloaded right after its
    forward pass)."""
    teacher_offload: str = attrs.field(default="cpu", validator=attrs.validators.in_(("cpu", "release")))
    """What offloading a teacher does: ``"cpu"`` moves its weights to host memory, ``"release"`` frees it and
    rebuilds it from its ``path`` on next use."""
    teacher_manager: str = component("teacher_manager", active=lambda section, job: bool(job.teachers),
                                     default="per_source")
    """The ``teacher_manager`` component that routes rows to teachers and bounds their residency."""
    teacher_cpus: float = attrs.field(default=1.0, validator=non_negative)
    """CPUs the teachers' actor reserves."""
    teacher_gpus: float = attrs.field(default=0.0, validator=non_negative)
    """GPUs the teachers' actor reserves."""
    teacher_resources: dict[str, float] = attrs.field(factory=dict, validator=custom_resources)
    """Custom Ray resources the teachers' actor reserves."""


@attrs.define
class LoggerConfig:
    """One metrics logger, by component name, with its arguments."""

    name: str = component("logger", args="args")
    """The logger component (``console``, ``jsonl``, ``tensorboard``, ``wandb``, or a plugin's)."""
    args: Args = attrs.field(factory=dict)
    """Keyword arguments of the logger's factory."""


@attrs.define
class RunConfig:
    """Run-level settings: seed, checkpoints, resume and the local Ray cluster.

    ``seed`` is in ``[0, 2**31 - 1]``. A run directory that already holds a run is continued with
    ``resume = true`` (from the newest intact checkpoint) and otherwise refused, unless the CLI's
    ``--overwrite`` moves the old run aside. ``keep_checkpoints = 0`` keeps every checkpoint."""

    seed: int = attrs.field(default=0, validator=valid_seed)
    """Seed of the run: the data order and the sampling seeds."""
    output_dir: str = "runs/default"
    """Run directory when the CLI gets no ``--output-dir`` (relative to the job file)."""
    resume: bool = False
    """Continue the run in the output directory from its newest intact checkpoint."""
    checkpoint_every: int = attrs.field(default=0, validator=in_range(ge=0))
    """Steps between checkpoints (0: no checkpoints)."""
    keep_checkpoints: int = attrs.field(default=2, validator=in_range(ge=0))
    """Checkpoints kept (the newest intact ones); 0 keeps every checkpoint."""
    save_hf_at_end: bool = True
    """Write ``final_hf/`` (and ``final_adapter/`` with LoRA) when the run ends."""
    ray_address: str | None = None
    """Join this Ray cluster instead of starting a local one (else the ``RAY_ADDRESS`` environment variable)."""
    ray_num_cpus: int | None = attrs.field(default=None, validator=in_range(ge=1, optional=True))
    """CPUs of the local Ray cluster (default: the machine's, or what the job reserves if more)."""
    ray_object_store_mb: int = attrs.field(default=256, validator=at_least_one)
    """Object store size of the local Ray cluster, in MiB."""
    ray_dashboard: bool = False
    """Start the Ray dashboard (loopback only) with the local cluster."""
    rollout_records: int = attrs.field(default=-1, validator=in_range(ge=-1))
    """Trajectories of each step written to ``rollouts/`` (-1: every one, 0: none, N: a sample of N), in the format of
    docs/reference/records.md."""


@attrs.define
class JobConfig:
    """A whole job file. TOML table ``[async]`` maps to :attr:`async_`."""

    plugins: PluginsConfig = attrs.field(factory=PluginsConfig)
    """Which plugins are active."""
    model: ModelConfig = attrs.field(factory=ModelConfig)
    """The policy model."""
    train: TrainConfig = attrs.field(factory=TrainConfig)
    """The trainer, its optimizer and batch sizes."""
    rollout: RolloutConfig = attrs.field(factory=RolloutConfig)
    """The rollout engines and sampling."""
    placement: PlacementConfig = attrs.field(factory=PlacementConfig)
    """Where actors live and what they reserve."""
    algorithm: AlgorithmConfig = attrs.field(factory=AlgorithmConfig)
    """The loss pipeline: advantages, policy loss, KL, aggregation, corrections, filters, distillation."""
    data: list[DataConfig] = attrs.field(factory=list)
    """The data sources, one ``[[data]]`` table each."""
    agentflow: AgentFlowConfig = attrs.field(factory=AgentFlowConfig)
    """The AgentFlow router agents talk to."""
    async_: AsyncConfig = attrs.field(factory=AsyncConfig, alias="async_")
    """Asynchronous training."""
    loggers: list[LoggerConfig] = attrs.field(factory=lambda: [LoggerConfig(name="console")])
    """Metrics loggers, one ``[[loggers]]`` table each (default: ``console``)."""
    teachers: list[TeacherConfig] = attrs.field(factory=list)
    """Distillation teachers, one ``[[teachers]]`` table each."""
    eval: EvalConfig = attrs.field(factory=EvalConfig)
    """Held-out evaluation during the run and for ``loongsage eval`` (``[eval]``)."""
    critic: CriticConfig = attrs.field(factory=CriticConfig)
    """The value model, for advantages that need one (``gae``)."""
    run: RunConfig = attrs.field(factory=RunConfig)
    """Seed, checkpoints, resume and the Ray cluster."""
    sft: SftConfig | None = None
    """Supervised fine-tuning (``loongsage sft``); a job with this table is an SFT job."""
    source_path: str | None = attrs.field(default=None, metadata={"internal": True})
    """The job file's path (set by the loader, not by the file)."""

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
