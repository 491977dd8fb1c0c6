"""Hook implementations of loongsage-plugin-rewards (the module its entry point names)."""

from __future__ import annotations

from loongsage_hookspecs import hookimpl  # noqa: F401
