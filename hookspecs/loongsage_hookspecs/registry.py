"""What a component may ask of the host's plugin registry (``BuildContext.components``): look a
spec up by kind and name, bind a component from a :class:`~.refs.ComponentRef`, list the specs of
a kind."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .refs import ComponentRef


@runtime_checkable
class ComponentRegistry(Protocol):
    """The active plugins' specs by kind (a word of :data:`~loongsage_hookspecs.KINDS`) and name."""

    def get(self, kind: str, name: str, where: str | None = None) -> Any:
        """The spec of ``kind`` called ``name``; an unknown name raises an error listing the choices
        (prefixed with ``where``, the job-file key at fault, when given). For reading a spec's
        declarations (``needs_sandbox``, ``auto_rank``, ...), never for calling its callables."""
        ...

    def bind(self, ref: ComponentRef, ctx: Any = None, *, using: str | None = None) -> Any:
        """The component ``ref`` names, ready to use: for a function kind a callable with the
        ref's arguments bound (call it with the kind's inputs), for a factory kind the object its
        factory builds (``ctx``: an instance of the kind's context class; ``using``: the factory
        field, for a kind with several, like a weight transport's ``receiver``). Arguments the
        component does not take and values it refuses are job errors naming ``ref.args_key``;
        anything else a factory raises is a run error naming the component and its plugin."""
        ...

    def components(self, kind: str) -> dict[str, Any]:
        """Every active spec of ``kind``, by name."""
        ...
