"""Where plugins come from: the ``loongsage`` entry points of installed distributions, user
hookimpl modules loaded by path, and the ``LOONGSAGE_DISABLE_PLUGINS`` block list.

Kept apart from :mod:`loongsage_core.plugins` (the host that registers and indexes what these
yield) so that discovery, which touches package metadata and imports user files, reads on its own.
"""

from __future__ import annotations

import importlib.metadata as importlib_metadata
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from loongsage_hookspecs import PROJECT_NAME, normalize_name

from .errors import PluginError

DISABLE_ENV = "LOONGSAGE_DISABLE_PLUGINS"
DIST_PREFIX = "loongsage-plugin-"


def aliases_of(entry_name: str, dist: str | None) -> frozenset[str]:
    """The names a plugin answers to in ``[plugins] enable``: its entry point's, its distribution's
    and that without the ``loongsage-plugin-`` prefix, normalised."""
    names = {normalize_name(entry_name)}
    if dist:
        names.add(normalize_name(dist))
        if normalize_name(dist).startswith(normalize_name(DIST_PREFIX)):
            names.add(normalize_name(dist)[len(DIST_PREFIX):])
    return frozenset(names)


def blocked_names(environ: dict[str, str] | None = None) -> set[str]:
    """Plugin names blocked by ``LOONGSAGE_DISABLE_PLUGINS``."""
    raw = (environ if environ is not None else os.environ).get(DISABLE_ENV, "")
    return {normalize_name(n) for n in raw.split(",") if n.strip()}


def installed_entry_points() -> list[importlib_metadata.EntryPoint]:
    """Entry points of the ``loongsage`` group, de-duplicated by (distribution, name)."""
    seen: set[tuple[str | None, str]] = set()
    result = []
    for ep in importlib_metadata.entry_points(group=PROJECT_NAME):
        key = (ep.dist.name if ep.dist else None, ep.name)
        if key not in seen:
            seen.add(key)
            result.append(ep)
    return sorted(result, key=lambda e: e.name)


def load_module_from_path(path: Path, key: str) -> Any:
    """Import a user hookimpl module from a file path under a unique module name."""
    name = f"loongsage_user_{abs(hash(str(path)))}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"{key}: cannot import '{path}' (not a Python file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:  # sys.exit() at import would end the CLI with no word of why
        sys.modules.pop(name, None)
        raise PluginError(f"{key}: importing '{path}' failed: the module called sys.exit({exc.code!r})") from None
    except Exception as exc:  # a user module may raise anything while importing
        sys.modules.pop(name, None)
        raise PluginError(f"{key}: importing '{path}' failed: {type(exc).__name__}: {exc}") from exc
    return module
