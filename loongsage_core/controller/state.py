"""The state of a run, declared once for every part of the controller that reads it.

``RLController`` (``run.py``) sets these in its constructor and start-up; the step
(``step.py``) and the run's lifecycle (``lifecycle.py``) are parts of it that read and update
them. Declaring them here gives the parts one typed view of the run instead of attributes that
only the assembled class defines.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from loongsage_hookspecs import Batch, TrajectoryGroup

    from ..algorithms import StepAlgorithm
    from ..config import JobConfig
    from ..plugins import PluginHost
    from ..records.writer import RolloutRecorder
    from .colocation import PhaseSwitch
    from .critic import Critic
    from .data import DataMixer
    from .faults import FaultSupervisor
    from .filters import GroupFilters
    from .health import StepHealth
    from .placement import Actors
    from .rollout import RolloutManager
    from .teacher_actor import Teachers


class RunState:
    """What a run holds: its job and components, its actors once started, and its progress."""

    job: JobConfig
    host: PluginHost
    output_dir: Path
    tokenizer: Any
    mixer: DataMixer
    needs_reference: bool
    teachers: Teachers | None
    algorithm: StepAlgorithm
    advantage: Any
    filters: GroupFilters
    loggers: list[Any]
    step: int
    version: int
    actors: Actors | None
    engine_router: Any
    phases: PhaseSwitch | None
    rollout: RolloutManager | None
    critic: Critic | None
    resumed_state: dict[str, Any] | None
    health: StepHealth
    faults: FaultSupervisor
    records: RolloutRecorder | None
    last_batch: Batch | None
    sampled_groups: list[TrajectoryGroup]
    loop: asyncio.AbstractEventLoop
    secret: str
    stop_signals: dict[int, Any]

    def _push_weights(self, version: int | None = None) -> dict[str, float]:
        """Move the trainer's weights into every engine (the step's part, ``step.py``, does it)."""
        raise NotImplementedError
