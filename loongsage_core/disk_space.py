"""A full disk, said plainly: which file could not be written and how much room is left.

``torch.save`` to a path reports a full disk as ``RuntimeError: [enforce fail at
inline_container.cc] unexpected pos ...``; through a Python file object the ``OSError`` (errno
``ENOSPC``) survives as the error's context. :func:`save_torch_atomically` writes that way and
raises the ``OSError`` itself, naming the file; :func:`disk_full_error` finds such an error in any
exception chain (Ray's wrapped remote errors included) and :func:`free_space` says how much room
the file's file system has left.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""No space left on the device, a disk quota exceeded, a file over its size limit (``RLIMIT_FSIZE``)."""

DISK_FULL_MARKERS = ("no space left on device", "disk quota exceeded", "file too large")
"""How those errors read once only their text is left (a remote error re-raised by Ray)."""


def save_torch_atomically(obj: Any, path: str | Path) -> None:
    """``torch.save(obj)`` to ``path.tmp``, then rename over ``path``: a crash leaves no
    half-written file. A write that fails for lack of room raises ``OSError`` (``ENOSPC``, ...)
    naming ``path``, with the temporary file removed."""
    import torch

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as fh:
            torch.save(obj, fh)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        full = disk_full_error(exc)
        if full is not None:
            raise OSError(full.errno, full.strerror or os.strerror(full.errno or 0), str(path)) from None
        raise
    os.replace(tmp, path)


def disk_full_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` of a full disk in ``exc``'s chain (its causes, contexts and a Ray error's
    ``cause``), or one made from the text of an error that lost its type; ``None`` if none."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_FULL_ERRNOS:
            return current
        text = str(current).lower()
        for code, marker in zip((errno.ENOSPC, errno.EDQUOT, errno.EFBIG), DISK_FULL_MARKERS):
            if marker in text and not isinstance(current, OSError):
                return OSError(code, os.strerror(code), _quoted_path(str(current)))
        for nxt in (current.__cause__, current.__context__, getattr(current, "cause", None)):
            if isinstance(nxt, BaseException):
                todo.append(nxt)
    return None


def _quoted_path(text: str) -> str | None:
    """The first ``'...'``-quoted absolute path in an error's text (how OSError prints its file)."""
    for part in text.split("'")[1::2]:
        if part.startswith("/"):
            return part
    return None


def free_space(path: str | Path) -> str:
    """``"12.3 MiB free of 1.0 GiB"`` on the file system that holds ``path`` (its nearest existing
    parent), or ``"free space unknown"``."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        usage = shutil.disk_usage(where)
    except OSError:
        return "free space unknown"
    return f"{_size(usage.free)} free of {_size(usage.total)}"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
