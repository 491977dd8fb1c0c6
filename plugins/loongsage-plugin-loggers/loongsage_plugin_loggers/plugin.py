"""Hook implementations of loongsage-plugin-loggers (the module its entry point names)."""

from __future__ import annotations

from loongsage_hookspecs import hookimpl  # noqa: F401
