"""Hook implementations of loongsage-plugin-schedulers (the module its entry point names).

The hook only lists specs; the strategies live in the modules beside this one, which import
nothing heavier than attrs, so listing components stays cheap.
"""

from __future__ import annotations

from collections.abc import Iterator

from loongsage_hookspecs import CheckpointableScheduler, DeadlineScheduler, SchedulerSpec, SourcePicker, hookimpl

from .no_window import NoWindowScheduler
from .sync import SyncScheduler
from .windowed import WindowedFifoScheduler, WindowGatedScheduler

_COMMON = "args batch_size, stale_steps, oversample, staleness"
# every shipped scheduler keeps per-source quotas, survives a checkpoint and tells a group's
# deadline, if it has one (the shared base)
_CAPABILITIES = (SourcePicker, CheckpointableScheduler, DeadlineScheduler)


@hookimpl
def loongsage_schedulers() -> Iterator[SchedulerSpec]:
    yield SchedulerSpec(
        name="sync", factory=SyncScheduler, capabilities=_CAPABILITIES,
        description=f"on-policy rounds: dispatch one step's groups into an empty pipeline, train on them "
                    f"(staleness 0); {_COMMON}")
    yield SchedulerSpec(
        name="no_window", factory=NoWindowScheduler, capabilities=_CAPABILITIES,
        description=f"dispatch up to capacity, train in completion order, drop groups staler than "
                    f"stale_steps; {_COMMON}")
    yield SchedulerSpec(
        name="window_gated", factory=WindowGatedScheduler, capabilities=_CAPABILITIES,
        description=f"dispatch at most stale_steps versions ahead, train groups due now first in completion "
                    f"order; staleness <= stale_steps, never drops; {_COMMON}")
    yield SchedulerSpec(
        name="windowed_fifo", factory=WindowedFifoScheduler, capabilities=_CAPABILITIES,
        description=f"window-gated dispatch, train strictly oldest first (dispatch order); staleness <= "
                    f"stale_steps, never drops; {_COMMON}")
