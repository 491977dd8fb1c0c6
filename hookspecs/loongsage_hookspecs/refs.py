"""A job file's reference to a component: :class:`ComponentRef`.

A job names a component with a flat pair of keys (``advantage = "grpo"`` and
``advantage_args = {...}``, a ``[[loggers]]`` table's ``name`` and ``args``, one entry of
``reward = [...]`` and its table in ``reward_args``). The host reads every such pair into one
:class:`ComponentRef`, and binding a ref (``ComponentRegistry.bind``) is the only way anything a
job names becomes callable or built: the kind says how it is called
(:data:`~loongsage_hookspecs.KINDS`), the name which spec, the arguments what the job gives it.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

import attrs


def _frozen_table(value: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if value is None:
        return MappingProxyType({})
    if not isinstance(value, Mapping):
        raise TypeError(f"component arguments must be a table, got {type(value).__name__} {value!r}")
    return MappingProxyType(dict(value))


@attrs.define(frozen=True)
class ComponentRef:
    """Component ``name`` of ``kind`` with the job's arguments ``args`` (its ``*_args`` table).

    ``where`` is the job-file key that names it (``"job.toml: data[0].agent"``) and
    ``args_where`` the key of its arguments (``"job.toml: data[0].agent_args"``; ``where`` when
    unset): errors about the name and the arguments name them.
    """

    kind: str
    name: str
    args: Mapping[str, Any] = attrs.field(factory=dict, converter=_frozen_table)
    where: str = "<job>"
    args_where: str | None = None

    @property
    def args_key(self) -> str:
        """The key errors about the arguments name."""
        return self.args_where or self.where

    def __reduce__(self) -> Any:  # a mappingproxy does not pickle; the ref crosses to Ray actors
        return (ComponentRef, (self.kind, self.name, dict(self.args), self.where, self.args_where))
