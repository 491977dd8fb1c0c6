"""Errors the host raises for bad user input; the CLI prints them as one line and exits 2."""

from __future__ import annotations

from .config import ConfigError


class PluginError(ValueError):
    """A plugin is missing, broken, blocked, or provides something invalid."""


class UnknownComponentError(PluginError):
    """A job file names a component no active plugin provides."""


class ConflictError(PluginError):
    """Two plugins provide a component of the same kind under the same name."""


class RunError(RuntimeError):
    """A run that cannot go on (a broken checkpoint, training that stopped making progress, an
    actor that died); the CLI prints the message as one line and exits 1."""


class ComponentBuildError(RunError):
    """A component's factory raised while building what the job names (not a bad argument: those
    are :class:`~loongsage_core.config.ConfigError`); the message names the job-file key, the
    component and its plugin, and the original exception is chained."""


class NotARunError(ValueError):
    """A directory given to ``loongsage view`` that is not a LoongSage run directory."""


USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, PluginError, NotARunError)
"""Exceptions that describe bad input (shown without a traceback)."""
