"""LoongSage plugin: asynchronous-training schedulers (sync, no_window, window_gated, windowed_fifo).

Every scheduler implements ``loongsage_hookspecs.Scheduler``: a deterministic state machine
deciding what the producer may dispatch, what a train step takes, and what must be dropped
because it could only be trained beyond the staleness bound.
"""

from .base import DROP_REASONS, BaseScheduler, GroupRecord, GroupState
from .no_window import NoWindowScheduler
from .staleness import STALENESS_MODES, generated_versions, group_staleness, token_staleness_mean
from .sync import SyncScheduler
from .windowed import WindowedFifoScheduler, WindowGatedScheduler

__version__ = "0.1.0"

__all__ = [
    "DROP_REASONS", "STALENESS_MODES", "BaseScheduler", "GroupRecord", "GroupState", "NoWindowScheduler",
    "SyncScheduler", "WindowGatedScheduler", "WindowedFifoScheduler", "generated_versions", "group_staleness",
    "token_staleness_mean",
]
