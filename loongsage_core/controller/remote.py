"""Calls from the controller to its actors, with Ray or in-process.

The controller talks to its actors the way Ray actor handles do: ``handle.method.remote(*args)``
returns a reference, :func:`gather` waits for a list of them. :class:`LocalActor` gives an
in-process object that same face (the call runs at once; an exception is raised by
:func:`gather`, as Ray raises it from ``ray.get``), so the controller's loop, its algorithm and
real workers can run in one process without a Ray cluster (the controller tests do).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterable, Iterator

_clock = threading.local()


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Count the block as time this thread spends waiting on actors or engines (not its own work);
    nested blocks count once. :func:`gather` and in-process calls count themselves."""
    depth = getattr(_clock, "depth", 0)
    _clock.depth = depth + 1
    start = time.perf_counter()
    try:
        yield
    finally:
        _clock.depth = depth
        if depth == 0:
            _clock.seconds = waited_s() + time.perf_counter() - start


def waited_s() -> float:
    """Seconds this thread has spent in :func:`waiting` blocks so far."""
    return float(getattr(_clock, "seconds", 0.0))


@contextlib.contextmanager
def own_time(into: dict[str, float], key: str) -> Iterator[None]:
    """Add to ``into[key]`` the block's elapsed seconds less what it spent :func:`waiting`: the
    controller's own work in it (building and padding batches, advantages, serialising rows,
    bookkeeping)."""
    start, waited = time.perf_counter(), waited_s()
    try:
        yield
    finally:
        own = time.perf_counter() - start - (waited_s() - waited)
        into[key] = into.get(key, 0.0) + own


class LocalRef:
    """The outcome of one in-process call: its value, or the exception it raised."""

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value = value
        self.error = error

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _LocalMethod:
    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> LocalRef:
        try:
            with waiting():  # the actor's work, done in this thread
                return LocalRef(self._fn(*args, **kwargs))
        except Exception as exc:  # delivered by gather(), like ray.get re-raises an actor's error
            return LocalRef(error=exc)


class LocalActor:
    """``obj`` behind a Ray-actor-handle face: ``LocalActor(obj).method.remote(*args)``."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self.obj, name))


def gather(refs: Iterable[Any]) -> list[Any]:
    """The results of ``refs`` in order: ``ray.get`` for Ray references, in-process ones as they are."""
    refs = list(refs)
    if all(isinstance(r, LocalRef) for r in refs):
        return [r.result() for r in refs]
    import ray

    with waiting():
        return list(ray.get(refs))
