"""Errors the host raises for bad user input; the CLI prints them as one line and exits 2."""

from __future__ import annotations

from .config import ConfigError


class PluginError(ValueError):
    """A plugin is missing, broken, blocked, or provides something invalid."""


class UnknownComponentError(PluginError):
    """A job file names a component no active plugin provides."""


class ConflictError(PluginError):
    """Two plugins provide a component of the same kind under the same name."""


class NotARunError(ValueError):
    """A directory given to ``loongsage view`` that is not a LoongSage run directory."""


USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, PluginError, NotARunError)
"""Exceptions that describe bad input (shown without a traceback)."""
