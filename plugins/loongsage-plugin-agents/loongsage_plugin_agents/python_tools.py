"""Python functions as agent tools: loading by import path, JSON schemas, calling.

A tool is any function named ``"package.module:function"`` (or ``"path/to/file.py:function"``).
Its OpenAI schema comes from the signature and docstring: the first paragraph is the
description, ``Args:`` lines (Google style) describe parameters, and type hints map to JSON types
(``Annotated[int, {"minimum": 0, "maximum": 1000}]`` adds JSON-schema keywords, which constrained
decoding enforces when the call is forced).
Parameters named ``sandbox`` or ``ctx`` are not shown to the model; the agent passes the
trajectory's sandbox / :class:`AgentContext` into them. A tool returns text, any JSON value, or
images (a Pillow image, or a list of strings and images), which reach the model as image parts
of its tool message (:func:`tool_content`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable

INJECTED = ("sandbox", "ctx")
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object",
               tuple: "array"}


class ToolError(ValueError):
    """A tool cannot be loaded or described (the message names the import path)."""


def load_function(path: str) -> Callable[..., Any]:
    """Import ``"module:function"`` or ``"file.py:function"``."""
    if not isinstance(path, str) or ":" not in path:
        raise ToolError(f"tool {path!r}: expected 'module:function' or 'path/to/file.py:function'")
    module_name, _, attr = path.rpartition(":")
    try:
        if module_name.endswith(".py"):
            file = Path(module_name).expanduser().resolve()
            if not file.is_file():
                raise ToolError(f"tool {path!r}: file {file} does not exist")
            name = f"loongsage_tools_{abs(hash(str(file)))}"
            module = sys.modules.get(name)
            if module is None:
                spec = importlib.util.spec_from_file_location(name, file)
                assert spec is not None and spec.loader is not None
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ToolError:
        raise
    except Exception as exc:
        raise ToolError(f"tool {path!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ToolError(f"tool {path!r}: {module_name!r} has no function {attr!r}")
    return fn


def _json_type(hint: Any) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:  # Annotated[int, {"minimum": 0}]: JSON-schema keywords added
        base, *extras = typing.get_args(hint)
        out = _json_type(base)
        for extra in extras:
            if isinstance(extra, dict):
                out.update(extra)
        return out
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _json_type(args[0]) if len(args) == 1 else {}
    if origin is typing.Literal:
        values = list(typing.get_args(hint))
        return {"enum": values}
    base = origin or hint
    if base in _JSON_TYPES:
        out: dict[str, Any] = {"type": _JSON_TYPES[base]}
        if base in (list, tuple) and typing.get_args(hint):
            out["items"] = _json_type(typing.get_args(hint)[0])
        return out
    return {}


def _doc_parts(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    doc = inspect.getdoc(fn) or ""
    description = doc.split("\n\n")[0].replace("\n", " ").strip()
    params: dict[str, str] = {}
    m = re.search(r"^(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?)+)", doc, re.MULTILINE)
    if m:
        for line in m.group(1).splitlines():
            pm = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?\s*:\s*(.+)", line)
            if pm:
                params[pm.group(1)] = pm.group(2).strip()
    return description, params


def function_schema(fn: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """The OpenAI ``tools`` entry for ``fn``: its parameters and no others (``additionalProperties``
    false: the function takes no other keyword, and a forced call's grammar then ends the object)."""
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:
        hints = {}
    description, docs = _doc_parts(fn)
    props: dict[str, Any] = {}
    required = []
    for pname, param in sig.parameters.items():
        if pname in INJECTED or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        prop = _json_type(hints.get(pname, param.annotation if param.annotation is not param.empty else Any))
        if pname in docs:
            prop["description"] = docs[pname]
        props[pname] = prop
        if param.default is param.empty:
            required.append(pname)
    return {"type": "function", "function": {
        "name": name or fn.__name__, "description": description or (name or fn.__name__),
        "parameters": {"type": "object", "properties": props, "required": required,
                       "additionalProperties": False}}}


async def call_tool(fn: Callable[..., Any], arguments: dict[str, Any], **injected: Any) -> str | list[dict[str, Any]]:
    """Call ``fn`` with the model's ``arguments`` plus injected ``sandbox``/``ctx``; its result as
    a tool message's content (:func:`tool_content`)."""
    params = inspect.signature(fn).parameters
    kwargs = dict(arguments)
    for key, value in injected.items():
        if key in params:
            kwargs[key] = value
    result = fn(**kwargs)
    if inspect.isawaitable(result):
        result = await result
    return tool_content(result)


def tool_content(result: Any) -> str | list[dict[str, Any]]:
    """A tool's result as a tool message's content: a string as it is; a Pillow image, or a list
    of strings and images (a screenshot and its caption), as chat content parts, each image a
    PNG ``image_url`` data URL (what a vision-language policy reads through the router); anything
    else as JSON (or its ``str``)."""
    if isinstance(result, str):
        return result
    if _is_image(result) or (isinstance(result, (list, tuple)) and any(_is_image(item) for item in result)):
        items = result if isinstance(result, (list, tuple)) else [result]
        return [image_part(item) if _is_image(item) else {"type": "text", "text": str(item)} for item in items]
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(result)


def _is_image(value: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow comes with the host
        return False
    return isinstance(value, Image.Image)


def image_part(image: Any) -> dict[str, Any]:
    """A Pillow image as a chat ``image_url`` part (PNG, base64 data URL)."""
    import base64
    import io

    out = io.BytesIO()
    image.save(out, "PNG")
    url = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}
