"""Structuring a parsed job file into a :class:`~.job.JobConfig`, and the errors it raises.

Loading goes through a cattrs converter with unknown keys rejected and strict scalar types
(``1`` is not a ``bool``, ``"1"`` not an ``int``; an ``int`` is accepted as a ``float``). Every
problem is raised as a :class:`ConfigError` that names the file, the dotted key and, for unknown
keys, the closest valid key. The same converter writes a job back as TOML (:func:`dump_job_toml`).
A component's own ``*_args`` table is structured into its attrs class by :func:`structure_args`.
"""

from __future__ import annotations

import difflib
import typing
from typing import Any, Mapping, TypeVar

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from .fields import Args, RangeError
from .job import TOML_RENAMES, JobConfig

A = TypeVar("A", bound=attrs.AttrsInstance)
"""An attrs class (component ``*_args`` schemas are attrs classes)."""


class ConfigError(ValueError):
    """A job file or override is invalid; the message names the file and the key at fault."""


# --------------------------------------------------------------------------------------------
# Strict structuring
# --------------------------------------------------------------------------------------------


def _strict(expected: type) -> Any:
    def structure(value: Any, _: Any) -> Any:
        ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise TypeError(f"expected {expected.__name__}, got {type(value).__name__} {value!r}")
        return value

    return structure


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    for t in (int, float, bool, str):
        conv.register_structure_hook(t, _strict(t))

    def structure_args(value: Any, _: Any) -> Args:
        if not isinstance(value, Mapping):
            raise TypeError(f"expected a table, got {type(value).__name__} {value!r}")
        return dict(value)

    conv.register_structure_hook_func(lambda t: t == Args, structure_args)

    def structure_name_list(value: Any, _: Any) -> list[str]:
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise TypeError(f"expected a name or a list of names, got {value!r}")

    conv.register_structure_hook_func(lambda t: t == list[str], structure_name_list)
    return conv


_CONVERTER = _make_converter()


def _rename_keys(raw: Any) -> Any:
    if isinstance(raw, dict):
        return {TOML_RENAMES.get(k, k): v for k, v in raw.items()}
    return raw


def field_names(cls: type) -> list[str]:
    """The attribute names of the attrs class ``cls`` that a job file may set (not internal ones)."""
    return [f.name for f in attrs.fields(cls) if not f.metadata.get("internal")]


def toml_name(name: str) -> str:
    """The job-file key of attribute ``name`` (``async_`` is written ``async``)."""
    inverse = {v: k for k, v in TOML_RENAMES.items()}
    return inverse.get(name, name)


def _check_keys(raw: Any, cls: type, path: str, where: str) -> None:
    """Reject unknown keys anywhere in ``raw`` with the dotted key and a did-you-mean hint."""
    if not isinstance(raw, dict):
        return
    names = field_names(cls)
    hints = typing.get_type_hints(cls)
    for key, value in raw.items():
        attr = TOML_RENAMES.get(key, key)
        dotted = f"{path}.{key}" if path else key
        if attr not in names:
            valid = [toml_name(n) for n in names]
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean '{(path + '.') if path else ''}{close[0]}'?)" if close else ""
            raise ConfigError(f"{where}: unknown key '{dotted}'{hint}; valid keys here: {', '.join(valid)}")
        sub = attrs_class_of(hints[attr])
        if sub is not None:
            if typing.get_origin(hints[attr]) is list:
                if isinstance(value, list):
                    for i, item in enumerate(value):
                        _check_keys(item, sub, f"{dotted}[{i}]", where)
            else:
                _check_keys(value, sub, dotted, where)


def attrs_class_of(tp: Any) -> type | None:
    """The attrs class inside ``tp`` (``X``, ``list[X]`` or ``X | None``), if any."""
    if attrs.has(tp):
        return tp
    for arg in typing.get_args(tp):
        if attrs.has(arg):
            return arg
    return None


def _describe_errors(exc: BaseException, where: str) -> ConfigError:
    messages = cattrs.transform_error(exc, path="$", format_exception=_format_exception)
    first = messages[0] if messages else str(exc)
    return ConfigError(f"{where}: {first}")


_FIELD_MARK = "\x00"


def _format_exception(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, RangeError):
        return f"{exc.message}{_FIELD_MARK}{exc.field}"  # the field joins the key path (see _tidy_path)
    if isinstance(exc, KeyError):
        return "required key is missing"
    if isinstance(exc, ValueError) and len(exc.args) >= 2 and isinstance(exc.args[1], attrs.Attribute):
        return f"{exc.args[0]} for '{exc.args[1].name}'"  # attrs validator failure
    if isinstance(exc, ForbiddenExtraKeysError):
        return f"unknown keys {sorted(exc.extra_fields)}"
    return str(exc) if str(exc) else type(exc).__name__


def _tidy_path(message: str) -> str:
    # cattrs writes paths as $.train.lr / $.data[0].weight; show them as dotted keys
    if _FIELD_MARK in message:  # a validator's field: "msg\0lr @ $.train" -> "msg @ $.train.lr"
        text, _, rest = message.partition(_FIELD_MARK)
        field, _, path = rest.partition(" @ ")
        message = f"{text} @ {path}.{field}" if path != "$" else f"{text} @ $.{field}"
    return message.replace("@ $.", "at key '").replace("@ $", "at the top level")


def structure_job(raw: Mapping[str, Any], source: str | None = None) -> JobConfig:
    """Build a :class:`JobConfig` from a parsed TOML mapping, with errors naming ``source``."""
    where = source or "<job>"
    raw = _rename_keys(dict(raw))
    _check_keys(raw, JobConfig, "", where)
    try:
        job = _CONVERTER.structure(raw, JobConfig)
    except (ClassValidationError, IterableValidationError) as exc:
        err = _describe_errors(exc, where)
        msg = _tidy_path(str(err))
        if "at key '" in msg:
            msg += "'"
        raise ConfigError(msg.replace("async_", "async")) from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {validator_message(exc)}") from None
    job.source_path = source
    return job


def structure_args(cls: type[A], args: Mapping[str, Any], key: str, owner: str) -> A:
    """A component's ``*_args`` table (e.g. ``[train] backend_args``) as the attrs class ``cls``.

    Unknown keys and invalid values raise ``ValueError`` naming ``key`` and, for unknown keys, the
    ``owner`` component and its valid keys.
    """
    valid = [f.name for f in attrs.fields(cls)]
    unknown = sorted(set(args) - set(valid))
    if unknown:
        raise ValueError(f"{key}: unknown keys {unknown} for the {owner}; valid keys: {', '.join(valid)}")
    try:
        return _CONVERTER.structure(dict(args), cls)
    except (ClassValidationError, IterableValidationError) as exc:
        message = _tidy_path(str(_describe_errors(exc, key)))
        raise ValueError(message + ("'" if "at key '" in message else "")) from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{key}: {validator_message(exc)}") from None


def structure_value(value: Any, tp: Any) -> Any:
    """``value`` as type ``tp`` by the job file's strict rules (``"1"`` is no ``int``, ``1`` no
    ``bool``; an ``int`` is a ``float``). Raises ``TypeError`` / ``ValueError`` saying what was
    expected; a type the rules do not cover (a union of plain types, a callable) passes ``value``
    through unchecked."""
    try:
        return _CONVERTER.structure(value, tp)
    except cattrs.errors.StructureHandlerNotFoundError:
        return value
    except (ClassValidationError, IterableValidationError) as exc:
        messages = cattrs.transform_error(exc, path="$", format_exception=_format_exception)
        raise TypeError(_tidy_path(messages[0] if messages else str(exc))) from None


def validator_message(exc: BaseException) -> str:
    """The sentence of a validation error. attrs' validators raise with ``(message, attribute,
    expected, value)`` as arguments, whose ``str`` is the whole tuple; their message alone says
    the field, what it must be and what it got."""
    first = exc.args[0] if exc.args else None
    return first if len(exc.args) > 1 and isinstance(first, str) else str(exc)


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def job_to_dict(job: JobConfig) -> dict[str, Any]:
    """The job as plain TOML-ready data (``None`` values dropped, ``async_`` written ``async``)."""
    data = _CONVERTER.unstructure(job)
    data.pop("source_path", None)
    data["async"] = data.pop("async_")
    return _drop_none(data)


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def dump_job_toml(job: JobConfig) -> str:
    """The resolved job as TOML text (what ``config.resolved.toml`` holds)."""
    import tomli_w

    return tomli_w.dumps(job_to_dict(job))
