"""Calls from the controller to its actors, with Ray or in-process.

The controller talks to its actors the way Ray actor handles do: ``handle.method.remote(*args)``
returns a reference, :func:`gather` waits for a list of them. :class:`LocalActor` gives an
in-process object that same face (the call runs at once; an exception is raised by
:func:`gather`, as Ray raises it from ``ray.get``), so the controller's loop, its algorithm and
real workers can run in one process without a Ray cluster (the controller tests do).
"""

from __future__ import annotations

from typing import Any, Iterable


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

    return list(ray.get(refs))
