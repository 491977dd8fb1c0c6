"""Job-file schema and loading.

A job file is TOML; its tables map onto attrs classes. Loading goes through cattrs with unknown
keys rejected and strict scalar types, and every problem is raised as a :class:`ConfigError` that
names the file, the dotted key and, for unknown keys, the closest valid key. ``key=value``
overrides (dotted paths, ``data.0.weight=0.5`` for list entries) are typed by the schema before
they are applied.

This package's modules, each importing only those listed before it:

* :mod:`.fields`: the ``*_args`` table type (``Args``) and the value-range validators;
* :mod:`.training`: the training tables (``[model]``, ``[train]``, ``[algorithm]``, ``[critic]``,
  ``[[teachers]]``, ``[sft]``);
* :mod:`.rollout`: the rollout tables (``[rollout]``, ``[[data]]``, ``[agentflow]``, ``[async]``);
* :mod:`.job`: the run-level tables and :class:`JobConfig`, the whole file;
* :mod:`.structuring`: parsed TOML -> :class:`JobConfig` (and back), and :class:`ConfigError`;
* :mod:`.loading`: reading a job file and applying ``key=value`` overrides.

Import the names from here (``from loongsage_core.config import JobConfig, load_job``); the
module a name lives in is not part of the interface.
"""

from __future__ import annotations

from loongsage_hookspecs import LORA_ALL_LINEAR

from .components import component_ref, component_refs, refs_by_field, section_refs
from .evaluation import EvalConfig
from .fields import SEED_MAX, Args, ComponentField, RangeError, component
from .job import TOML_RENAMES, JobConfig, LoggerConfig, PlacementConfig, PluginsConfig, RunConfig
from .loading import apply_override, load_job, merge_tables
from .rollout import AgentFlowConfig, AsyncConfig, DataConfig, RolloutConfig
from .structuring import A, ConfigError, dump_job_toml, job_to_dict, structure_args, structure_job, structure_value
from .training import (
    AlgorithmConfig,
    CriticConfig,
    LoraConfig,
    ModelConfig,
    SftConfig,
    TeacherConfig,
    TrainConfig,
)

__all__ = [
    "A",
    "AgentFlowConfig",
    "AlgorithmConfig",
    "Args",
    "AsyncConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "EvalConfig",
    "JobConfig",
    "LORA_ALL_LINEAR",
    "LoggerConfig",
    "LoraConfig",
    "ModelConfig",
    "PlacementConfig",
    "PluginsConfig",
    "RangeError",
    "RolloutConfig",
    "RunConfig",
    "SEED_MAX",
    "SftConfig",
    "TOML_RENAMES",
    "TeacherConfig",
    "TrainConfig",
    "apply_override",
    "dump_job_toml",
    "job_to_dict",
    "load_job",
    "merge_tables",
    "structure_args",
    "structure_job",
    "structure_value",
    "component_ref",
    "component_refs",
    "section_refs",
    "refs_by_field",
    "ComponentField",
    "component",
]
