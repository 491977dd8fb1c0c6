"""LoongSage host: plugin manager, job-file schema, controller, AgentFlow router and CLI.

Importing this package is cheap: torch, ray and transformers are imported only by the modules
that need them, when they are used. The public reading API of a run's rollout records
(docs/reference/records.md) is re-exported here: :func:`read_rollouts`, :func:`rollout_steps`.
"""

__version__ = "0.1.0"

from .records import RolloutRecordsError, read_rollouts, rollout_steps

__all__ = ["RolloutRecordsError", "__version__", "read_rollouts", "rollout_steps"]
