"""LoongSage plugin contract: hook markers, hookspecs, component specs and records.

Plugin authors depend on this package only::

    from loongsage_hookspecs import hookimpl, RewardSpec

    @hookimpl
    def loongsage_rewards():
        yield RewardSpec(name="my_reward", fn=my_reward)

and register the module under the ``loongsage`` entry-point group.
"""

from __future__ import annotations

from . import hookspecs
from .capabilities import (
    Closeable,
    ConstrainsToolCalls,
    DeadlineScheduler,
    LoadsWeights,
    LoraAwareSender,
    LoraTrainer,
    ModelParallel,
    ObservingMiddleware,
    Offloadable,
    OnDevice,
    ReplaceableEngines,
    ReportsIsolation,
    ResidentTeacher,
    ReusesTrainingLogprobs,
    RunsPrograms,
    SharesPrompts,
    SourcePicker,
    StepTruncation,
    StepwiseTraining,
    StreamingMiddleware,
    TrajectoryLogger,
    is_capability,
    missing_members,
)
from .chat import prompt_messages
from .contexts import (
    BuildContext,
    EngineRouterContext,
    LoggerContext,
    SchedulerContext,
    TeacherContext,
    TeacherManagerContext,
    WeightTransportContext,
)
from .kinds import KINDS, Call, Kind, kind_of
from .lora import LORA_ADAPTER_NAME, LORA_ALL_LINEAR, LORA_PEFT_PREFIX, LORA_TENSOR_SUFFIXES, is_lora_tensor
from .markers import PROJECT_NAME, hookimpl, hookspec
from .protocols import (
    Agent,
    CheckpointableScheduler,
    EngineContext,
    EngineRouter,
    MetricsLogger,
    RolloutEngine,
    RouterMiddleware,
    Sandbox,
    SandboxProvider,
    Scheduler,
    Teacher,
    TeacherRouter,
    TrainWorker,
    TrainWorkerContext,
    WeightReceiver,
    WeightSender,
)
from .records import (
    BATCH_FIELDS,
    AdvantageInputs,
    AdvantageOutput,
    AgentContext,
    AgentFailure,
    AgentResult,
    AggregationNorm,
    Batch,
    CorrectionInputs,
    CorrectionOutput,
    ExecResult,
    FailureClass,
    GrammarSpan,
    KLInputs,
    PolicyLossInputs,
    PolicyLossOutput,
    Reward,
    RoutedExperts,
    SamplingParams,
    Segment,
    SegmentImage,
    TeacherOutputs,
    TensorMeta,
    Trajectory,
    TrajectoryGroup,
    TrajectoryStatus,
    WeightBucket,
    WeightTarget,
    teacher_inputs,
)
from .refs import ComponentRef
from .registry import ComponentRegistry
from .sandbox_request import SandboxRequest, sandbox_request
from .settings import (
    AlgorithmSettings,
    CriticSettings,
    JobSettings,
    LoraSettings,
    ModelSettings,
    PlacementSettings,
    RolloutSettings,
    RunSettings,
    TrainSettings,
)
from .specs import (
    AdvantageSpec,
    AgentSpec,
    AggregationSpec,
    ComponentSpec,
    CorrectionSpec,
    DataSourceSpec,
    EngineRouterSpec,
    FilterSpec,
    KLSpec,
    LoggerSpec,
    PolicyLossSpec,
    RewardSpec,
    RolloutEngineSpec,
    RouterMiddlewareSpec,
    SandboxSpec,
    SchedulerSpec,
    TeacherManagerSpec,
    TeacherSpec,
    TrainBackendSpec,
    WeightTransportSpec,
    normalize_name,
)
from .versions import parse_weight_version

__version__ = "0.1.0"

__all__ = [name for name in dir() if not name.startswith("_") and name not in {"annotations"}]
