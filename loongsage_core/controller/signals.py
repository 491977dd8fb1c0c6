"""Ctrl-C (SIGINT) and SIGTERM end a run or a server cleanly.

Process managers (a cluster scheduler, a container runtime, ``kill``) send SIGTERM; a person sends
SIGINT. Both must reach Python as :class:`KeyboardInterrupt`, so that the ``finally`` blocks that
stop engines, sandboxes and the Ray actors run. Two things stand in the way, and
:func:`stop_on_signals` handles both:

* a background job of a non-interactive shell starts with SIGINT *ignored*, so Ctrl-C or
  ``kill -INT`` would do nothing;
* the Ray driver installs a native SIGTERM handler that aborts the process (exit 134) without
  running any Python cleanup.

It must be called after Ray started (its handler replaces Ray's) and only takes effect in the main
thread (Python delivers signals there); :func:`restore_signals` puts the previous handlers back.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stop(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def stop_on_signals() -> dict[int, Any]:
    """SIGINT and SIGTERM raise :class:`KeyboardInterrupt` from now on; returns the handlers they
    had (empty off the main thread, where nothing is changed)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {int(s): signal.getsignal(s) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        signal.signal(s, _stop)
    return previous


def restore_signals(previous: dict[int, Any]) -> None:
    """Give SIGINT and SIGTERM back the handlers :func:`stop_on_signals` returned."""
    for signum, handler in previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
