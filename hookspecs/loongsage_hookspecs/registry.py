"""What a component may ask of the host's plugin registry (``TrainWorkerContext.components``,
``EngineContext.components``): look a spec up by kind and name, build a component from it, list
the specs of a kind."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class ComponentRegistry(Protocol):
    """The active plugins' specs by kind (a word of :data:`~loongsage_hookspecs.KINDS`) and name."""

    def get(self, kind: str, name: str, where: str | None = None) -> Any:
        """The spec of ``kind`` called ``name``; an unknown name raises an error listing the choices
        (prefixed with ``where``, the job-file key at fault, when given)."""
        ...

    def build(self, kind: str, name: str, ctx: Any, *, where: str | None = None, args_key: str | None = None,
              using: str = "factory", **args: Any) -> Any:
        """Build ``kind`` ``name``: ``spec.<using>(ctx, **args)`` (``using``: the factory attribute,
        ``ctx``: an instance of the kind's context class,
        :data:`~loongsage_hookspecs.protocols.BUILD_CONTEXTS`; anything else is a ``TypeError``);
        arguments it does not take and ``ValueError`` become job errors naming ``args_key`` /
        ``where`` (default ``ctx.where``), anything else it raises a run error naming the component and its plugin."""
        ...

    def components(self, kind: str) -> dict[str, Any]:
        """Every active spec of ``kind``, by name."""
        ...
