"""Every component a job names, read off the schema: :func:`component_refs`.

The schema's fields that name a component carry their kind (:func:`~.fields.component`); a job
file keeps its flat keys (``advantage = "grpo"`` and ``advantage_args = {...}``, a ``[[loggers]]``
table's ``name`` and ``args``, the names of ``reward = [...]`` and their tables in
``reward_args``), and this walker pairs each name with its arguments into a
:class:`~loongsage_hookspecs.ComponentRef` that names both keys. Validation, the run and the
backends all read components this one way.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

import attrs

from loongsage_hookspecs import ComponentRef

from .fields import ComponentField
from .job import TOML_RENAMES

_TOML_NAMES = {attr: key for key, attr in TOML_RENAMES.items()}


def component_refs(job: Any, kinds: Iterable[str] | None = None) -> Iterator[ComponentRef]:
    """The components ``job`` uses, in the order of its schema, each with its job-file keys.

    ``kinds``, when given, keeps only those kinds. Components the job does not use (an unset
    name, a scheduler of a synchronous run) are left out.
    """
    wanted = set(kinds) if kinds is not None else None
    where = job.source_path or "<job>"
    for ref in _walk(job, job, "", where):
        if wanted is None or ref.kind in wanted:
            yield ref


def section_refs(section: Any, path: str, job: Any) -> Iterator[ComponentRef]:
    """The components one table of ``job`` names (``section`` at key ``path``, e.g. the job's
    ``algorithm`` table at ``"algorithm"``)."""
    yield from _walk(section, job, path, job.source_path or "<job>")


def refs_by_field(section: Any, path: str, job: Any) -> dict[str, list[ComponentRef]]:
    """The components one table of ``job`` names, by the field that names them (``"kl"``,
    ``"corrections"``, ...; a field whose component the job does not use is absent)."""
    where = job.source_path or "<job>"
    out: dict[str, list[ComponentRef]] = {}
    for field in attrs.fields(type(section)):
        meta: ComponentField | None = field.metadata.get("component")
        if meta is not None:
            refs = list(_refs(meta, section, job, getattr(section, field.name), _join(path, field.name),
                              _join(path, meta.args) if meta.args else _join(path, field.name), where))
            if refs:
                out[field.name] = refs
    return out


def component_ref(job: Any, key: str) -> ComponentRef:
    """The one component at job-file ``key`` (``"train.backend"``, ``"algorithm.loss_agg"``); a
    key that names no component of the job is the host's own bug (``KeyError``)."""
    where = job.source_path or "<job>"
    for ref in component_refs(job):
        if ref.where == f"{where}: {key}":
            return ref
    raise KeyError(f"the job names no component at '{key}'")


def _join(path: str, name: str) -> str:
    name = _TOML_NAMES.get(name, name)
    return f"{path}.{name}" if path else name


def _walk(obj: Any, job: Any, path: str, where: str) -> Iterator[ComponentRef]:
    for field in attrs.fields(type(obj)):
        value = getattr(obj, field.name)
        key = _join(path, field.name)
        meta: ComponentField | None = field.metadata.get("component")
        if meta is not None:
            yield from _refs(meta, obj, job, value, key, _join(path, meta.args) if meta.args else key, where)
        elif attrs.has(type(value)):
            yield from _walk(value, job, key, where)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if attrs.has(type(item)):
                    yield from _walk(item, job, f"{key}[{i}]", where)


def _refs(meta: ComponentField, section: Any, job: Any, value: Any, key: str, args_key: str,
          where: str) -> Iterator[ComponentRef]:
    if not value or (meta.active is not None and not meta.active(section, job)):
        return
    args: Mapping[str, Any] = getattr(section, meta.args) if meta.args else {}
    if isinstance(value, list):  # several names, one table of arguments per name
        for i, name in enumerate(value):
            yield ComponentRef(meta.kind, name, args.get(name, {}), where=f"{where}: {key}[{i}]",
                               args_where=f"{where}: {args_key}.{name}")
    else:
        yield ComponentRef(meta.kind, value, args, where=f"{where}: {key}", args_where=f"{where}: {args_key}")
