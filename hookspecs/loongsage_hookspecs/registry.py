"""What a component may ask of the host's plugin registry (``TrainWorkerContext.components``,
``EngineContext.components``): look a spec up by kind and name, list the specs of a kind."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class ComponentRegistry(Protocol):
    """The active plugins' specs by kind (a word of :data:`~loongsage_hookspecs.KINDS`) and name."""

    def get(self, kind: str, name: str, where: str | None = None) -> Any:
        """The spec of ``kind`` called ``name``; an unknown name raises an error listing the choices
        (prefixed with ``where``, the job-file key at fault, when given)."""
        ...

    def components(self, kind: str) -> dict[str, Any]:
        """Every active spec of ``kind``, by name."""
        ...
