"""Reading a job file from disk and applying ``key=value`` overrides to it.

:func:`load_job` reads the TOML file, applies the overrides and hands the result to
:func:`~.structuring.structure_job`. Overrides take dotted paths (``train.lr=1e-6``, and
``data.0.weight=0.5`` for list entries); each value is typed by the schema before it is applied
(a ``str`` field keeps its text as is, other fields parse it as a TOML value), and tables merge
key by key rather than replace (:func:`merge_tables`).
"""

from __future__ import annotations

import difflib
import sys
import typing
from pathlib import Path
from typing import Any, Sequence

from .job import TOML_RENAMES, JobConfig
from .structuring import ConfigError, attrs_class_of, field_names, structure_job, toml_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def load_job(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    """Read a TOML job file, apply ``key=value`` overrides, and structure it."""
    path = Path(path)
    where = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{where}: job file not found") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 text (byte {exc.start}: {exc.reason}); "
                          "job files are UTF-8 TOML") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read job file: {exc.strerror or exc}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: malformed TOML: {exc}") from None
    for item in overrides:
        apply_override(raw, item, where)
    return structure_job(raw, str(path))

# --------------------------------------------------------------------------------------------
# key=value overrides
# --------------------------------------------------------------------------------------------


def _parse_dotted(key: str) -> list[str]:
    return [part for part in key.replace("[", ".").replace("]", "").split(".") if part]


def _type_at(parts: Sequence[str], where: str, original: str) -> Any:
    """The schema type at a dotted path, or raise naming the unknown part."""
    tp: Any = JobConfig
    walked: list[str] = []
    for part in parts:
        cls = attrs_class_of(tp) if not (typing.get_origin(tp) is list and part.isdigit()) else None
        if typing.get_origin(tp) is list and part.isdigit():
            tp = typing.get_args(tp)[0]
        elif cls is not None:
            attr = TOML_RENAMES.get(part, part)
            hints = typing.get_type_hints(cls)
            if attr not in field_names(cls):
                valid = [toml_name(n) for n in field_names(cls)]
                close = difflib.get_close_matches(part, valid, n=1)
                hint = f" (did you mean '{'.'.join(walked + [close[0]])}'?)" if close else ""
                raise ConfigError(f"{where}: override '{original}': unknown key '{'.'.join(walked + [part])}'{hint}")
            tp = hints[attr]
        elif _is_table_type(tp):
            return Any  # inside a free-form table (``*_args``)
        else:
            name = getattr(tp, "__name__", str(tp))
            raise ConfigError(f"{where}: override '{original}': '{'.'.join(walked)}' is a {name}, not a table, "
                              f"so it has no key '{part}'")
        walked.append(part)
    return tp


def _is_table_type(tp: Any) -> bool:
    """Whether ``tp`` is a free-form table (``Args``, ``dict[...]``) or unknown (``Any``)."""
    return tp is Any or tp is dict or typing.get_origin(tp) is dict


def _parse_value(text: str, tp: Any) -> Any:
    if tp is str or tp == (str | None):
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(raw: dict[str, Any], item: str, where: str = "<overrides>") -> None:
    """Apply one ``dotted.key=value`` override to the raw TOML mapping, typed by the schema."""
    if "=" not in item:
        raise ConfigError(f"{where}: override '{item}' is not of the form key=value")
    key, _, text = item.partition("=")
    parts = _parse_dotted(key.strip())
    if not parts:
        raise ConfigError(f"{where}: override '{item}' has an empty key")
    tp = _type_at(parts, where, item)
    value = _parse_value(text.strip(), tp)
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(node, list):
            if not part.isdigit():
                raise ConfigError(f"{where}: override '{item}': '{'.'.join(parts[:i])}' is a list; "
                                  f"use an index, not '{part}'")
            idx = int(part)
            while len(node) <= idx:
                node.append({})
            node = node[idx]
        elif isinstance(node, dict):
            node = node.setdefault(part, [] if nxt.isdigit() else {})
        else:
            raise ConfigError(f"{where}: override '{item}': '{'.'.join(parts[:i])}' is "
                              f"{type(node).__name__} {node!r}, not a table, so it has no key '{part}'")
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"{where}: override '{item}': '{'.'.join(parts[:i + 1])}' is "
                              f"{type(node).__name__} {node!r}, not a table, so it has no key '{nxt}'")
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit():
            raise ConfigError(f"{where}: override '{item}': '{'.'.join(parts[:-1])}' is a list; "
                              f"use an index, not '{last}'")
        idx = int(last)
        while len(node) <= idx:
            node.append({})
        node[idx] = merge_tables(node[idx], value)
    else:
        node[last] = merge_tables(node.get(last), value)


def merge_tables(old: Any, new: Any) -> Any:
    """``new`` laid over ``old``: tables merge key by key (recursively), anything else replaces.

    So ``train={lr=1}`` changes ``train.lr`` and keeps the rest of ``[train]``.
    """
    if isinstance(old, dict) and isinstance(new, dict):
        merged = dict(old)
        for key, value in new.items():
            merged[key] = merge_tables(old.get(key), value)
        return merged
    return new
