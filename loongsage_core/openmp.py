"""Giving back a thread's idle OpenMP workers, for a trainer and an engine sharing one process.

torch's CPU operators run their parallel regions on an OpenMP thread team that belongs to the
calling thread and lives as long as it does. A colocated actor (``[placement] colocate = true``)
has two such threads: the one running the trainer's calls and the engine's loop. With more
OpenMP threads alive than cores, GNU libgomp (the runtime torch's Linux wheels load) stops
spinning between parallel regions, and every parallel operator then pays to wake its workers
through the kernel. On the 2-core machine a 135M-shaped model decoded 32 requests at 114 ms a
step beside an idle trainer team against 83 ms alone; the trainer's optimizer step took 0.35 s
beside an idle engine team against 0.28 s.

:func:`release_idle_threads` ends the calling thread's team (``omp_pause_resource_all`` with
``omp_pause_soft``: libgomp frees the caller's thread pool, and the next parallel region starts
a new one in microseconds). The engine's loop thread ends when idle instead; the actor calls this
after each trainer call. Only libgomp is called: other runtimes pause every thread of the process,
which is not what a caller that shares it wants.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Callable

OMP_PAUSE_SOFT = 1
"""``omp_pause_soft`` of the OpenMP 5.0 ``omp_pause_resource_t`` enumeration."""


@functools.cache
def _pause_all() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of the libgomp this process has loaded, or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = [line.split()[-1] for line in maps if "/libgomp" in line]
    except OSError:
        return None
    if not paths:
        return None
    try:
        fn = ctypes.CDLL(paths[0]).omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    pause: Callable[[int], int] = fn
    return pause


def release_idle_threads() -> bool:
    """End the calling thread's idle OpenMP workers (see the module docstring); ``False`` where
    this process has no libgomp loaded yet or it cannot pause (it is then a no-op)."""
    pause = _pause_all()
    if pause is None:
        if "torch" not in sys.modules:  # torch loads the runtime: ask again once it is here, then no more
            _pause_all.cache_clear()
        return False
    return pause(OMP_PAUSE_SOFT) == 0
