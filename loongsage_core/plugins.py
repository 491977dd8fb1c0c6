"""The plugin host: discovers plugins, registers them with pluggy and resolves components.

Plugins are found through the ``loongsage`` entry-point group (one per installed
``loongsage-plugin-*`` distribution) and, for user code, through hookimpl modules named by path in
the job file. Every provider hook is called once; the specs it returns are indexed by kind and
normalised name. A name provided by two plugins is an error naming both; an unknown name is an
error that lists the choices.

Selection rules (``[plugins] enable``):

* empty list: every installed plugin is imported and active; one that fails to import is a
  warning and is skipped;
* otherwise only the named ones (distribution name ``loongsage-plugin-rl``, entry-point name ``rl``
  or the short name after ``loongsage-plugin-``) plus user modules are imported and active: the
  other entry points are read from their distributions' metadata and never loaded, in the driver
  and in every actor. A named plugin that is missing, broken or blocked is a hard error listing
  what is installed.

``LOONGSAGE_DISABLE_PLUGINS`` (comma separated names) blocks plugins before they are imported.
"""

from __future__ import annotations

import difflib
import types
import warnings
from pathlib import Path
from typing import Any, Sequence

import attrs
import pluggy

from loongsage_hookspecs import (
    KINDS,
    PROJECT_NAME,
    ComponentRef,
    ComponentSpec,
    hookimpl,
    hookspecs,
    kind_of,
    normalize_name,
)

from . import binding
from .errors import ConflictError, PluginError, UnknownComponentError
from .plugin_sources import (
    DISABLE_ENV,
    aliases_of,
    blocked_names,
    installed_entry_points,
    load_module_from_path,
)


class PluginWarning(UserWarning):
    """An installed plugin that the job does not name failed to load and was skipped."""


@attrs.define
class PluginInfo:
    """One registered plugin: its names, version and where it came from."""

    name: str
    dist: str | None
    version: str
    source: str
    aliases: frozenset[str]


@attrs.define
class Provided:
    """A component spec and the plugin that provided it."""

    spec: ComponentSpec
    plugin: str


def _returning(specs: list[ComponentSpec]) -> Any:
    """A provider hook implementation (no arguments) that returns ``specs``."""
    def hook() -> list[ComponentSpec]:
        return list(specs)
    return hook


class PluginHost:
    """Registered plugins and the components they provide, indexed by kind and name."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.skipped: dict[str, str] = {}
        self.available: dict[str, frozenset[str]] = {}  # every installed entry point (metadata only): aliases
        self._active: set[str] | None = None
        self._index: dict[str, dict[str, Provided]] | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(cls, enable: Sequence[str] = (), modules: Sequence[str] = (), *, base_dir: Path | None = None,
               where: str = "[plugins]", entry_points: bool = True) -> "PluginHost":
        """Discover installed plugins, load user modules and activate the ``enable`` selection."""
        host = cls()
        if entry_points:
            wanted = [normalize_name(n) for n in enable]
            host.load_entry_points(required=wanted, where=where, only=wanted or None)
        for i, item in enumerate(modules):
            path = Path(item).expanduser()
            if not path.is_absolute():
                path = (base_dir or Path.cwd()) / path
            key = f"{where} modules[{i}]"
            if not path.is_file():
                raise PluginError(f"{key}: user module '{item}' not found (looked at {path})")
            host.register_module(load_module_from_path(path.resolve(), key), name=f"module:{path.stem}",
                                 source=str(path))
        host.activate(enable, where=where)
        return host

    @classmethod
    def from_job(cls, job: Any) -> "PluginHost":
        """The host for a job: its ``[plugins]`` selection, user modules relative to the job file."""
        where = f"{job.source_path or '<job>'}: [plugins]"
        return cls.create(job.plugins.enable, job.plugins.modules, base_dir=job.base_dir, where=where)

    def load_entry_points(self, required: Sequence[str] = (), where: str = "[plugins]",
                          only: Sequence[str] | None = None) -> None:
        """Import and register the installed, unblocked plugins of the entry-point group: all of
        them, or with ``only`` those an alias of which it names (the rest stay unimported)."""
        blocked = blocked_names()
        for ep in installed_entry_points():
            dist = ep.dist.name if ep.dist else None
            aliases = aliases_of(ep.name, dist)
            label = dist or ep.name
            self.available[ep.name] = aliases
            if only is not None and not aliases & set(only):
                continue  # not enabled: listed from metadata, never imported
            if aliases & blocked:
                self.pm.set_blocked(ep.name)
                self.skipped[label] = f"blocked by {DISABLE_ENV}"
                continue
            try:
                module = ep.load()
            except (Exception, SystemExit) as exc:  # a broken plugin may raise (or exit) on import
                reason = (f"import failed: it called sys.exit({exc.code!r})" if isinstance(exc, SystemExit)
                          else f"import failed: {type(exc).__name__}: {exc}")
                if aliases & set(required):
                    raise PluginError(f"{where}: plugin '{label}' is enabled but broken ({reason})") from exc
                warnings.warn(f"skipping plugin '{label}': {reason}", PluginWarning, stacklevel=2)
                self.skipped[label] = reason
                continue
            version = ep.dist.version if ep.dist else "0"
            self.register_module(module, name=ep.name, source=f"entry point {ep.value}",
                                 dist=dist, version=version)

    def register_module(self, module: Any, *, name: str, source: str, dist: str | None = None,
                        version: str = "0") -> None:
        """Register a hookimpl module (or object) and check its hook names against the contract."""
        try:
            self.pm.register(module, name=name)
            self.pm.check_pending()
        except (pluggy.PluginValidationError, ValueError) as exc:
            if self.pm.is_registered(module):
                self.pm.unregister(module)
            raise PluginError(f"plugin '{dist or name}' ({source}): {exc}") from exc
        version = getattr(module, "__version__", None) or version
        self.plugins[name] = PluginInfo(name=name, dist=dist, version=str(version), source=source,
                                        aliases=aliases_of(name, dist))
        self._index = None

    def register_specs(self, *specs: ComponentSpec, name: str = "module:inline") -> None:
        """Provide ``specs`` as one more plugin, as a hookimpl module would, and make them selectable.

        For code that builds components without a job file, a plugin's own tests above all: the
        real host with the real plugins, plus the few specs a test defines itself.
        """
        by_hook: dict[str, list[ComponentSpec]] = {}
        for spec in specs:
            by_hook.setdefault(kind_of(spec).hook, []).append(spec)
        plugin = types.SimpleNamespace(**{hook: hookimpl(_returning(listed)) for hook, listed in by_hook.items()})
        self.register_module(plugin, name=name, source="register_specs")
        if self._active is not None:
            self._active.add(name)

    def activate(self, enable: Sequence[str], where: str = "[plugins]") -> None:
        """Make only the named plugins' components selectable (all when ``enable`` is empty)."""
        if not enable:
            self._active = None
            self._index = None
            return
        active: set[str] = {name for name in self.plugins if name.startswith("module:")}
        blocked = blocked_names()
        for raw in enable:
            wanted = normalize_name(raw)
            match = [p.name for p in self.plugins.values() if wanted in p.aliases]
            if not match:
                if wanted in blocked:
                    raise PluginError(f"{where}: plugin '{raw}' is enabled but blocked by {DISABLE_ENV}")
                installed = ", ".join(self.installed_names()) or "none"
                known = {a for p in self.plugins.values() for a in p.aliases} | \
                    {a for aliases in self.available.values() for a in aliases}
                close = difflib.get_close_matches(wanted, sorted(known), 1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise PluginError(f"{where}: plugin '{raw}' is not installed{hint}; installed: {installed}")
            active.update(match)
        self._active = active
        self._index = None

    # ------------------------------------------------------------------ queries

    def installed_names(self) -> list[str]:
        """Short names of installed entry-point plugins (what ``enable`` accepts), imported or not."""
        names = set(self.available)
        names.update(p.name for p in self.plugins.values() if not p.name.startswith("module:"))
        return sorted(names)

    def active_plugins(self) -> list[PluginInfo]:
        return [p for p in self.plugins.values() if self._active is None or p.name in self._active]

    def _build_index(self) -> dict[str, dict[str, Provided]]:
        index: dict[str, dict[str, Provided]] = {kind: {} for kind in KINDS}
        active = {p.name for p in self.active_plugins()}
        for kind in KINDS.values():
            hook = getattr(self.pm.hook, kind.hook)
            for impl in reversed(hook.get_hookimpls()):  # registration order, for stable messages
                plugin = self.pm.get_name(impl.plugin) or "?"
                if plugin not in active:
                    continue
                try:
                    specs = list(impl.function() or ())
                except Exception as exc:
                    raise PluginError(f"plugin '{plugin}': hook {kind.hook} raised {type(exc).__name__}: {exc}") \
                        from exc
                for spec in specs:
                    if not isinstance(spec, kind.spec):
                        raise PluginError(f"plugin '{plugin}': {kind.hook} returned {type(spec).__name__}, "
                                          f"expected {kind.spec.__name__}")
                    other = index[kind.name].get(spec.name)
                    if other is not None:
                        raise ConflictError(f"conflicting plugins: {kind.name} '{spec.name}' provided by "
                                            f"'{other.plugin}' and '{plugin}'")
                    index[kind.name][spec.name] = Provided(spec=spec, plugin=plugin)
        return index

    @property
    def index(self) -> dict[str, dict[str, Provided]]:
        if self._index is None:
            self._index = self._build_index()
        return self._index

    def components(self, kind: str) -> dict[str, Any]:
        """Specs of ``kind`` by name, from active plugins."""
        self._check_kind(kind)
        return {name: p.spec for name, p in sorted(self.index[kind].items())}

    def get(self, kind: str, name: str, where: str | None = None) -> Any:
        """The spec of ``kind`` called ``name``; an unknown name lists the choices."""
        self._check_kind(kind)
        prefix = f"{where}: " if where else ""
        try:
            key = normalize_name(name)
        except ValueError as exc:  # an empty name in a job file: the same error as an unknown one
            listing = ", ".join(sorted(self.index[kind])) or "none (enable a plugin that provides one)"
            raise UnknownComponentError(f"{prefix}{kind} {exc}; choose one of: {listing}") from None
        provided = self.index[kind].get(key)
        if provided is None:
            choices = sorted(self.index[kind])
            close = difflib.get_close_matches(key, choices, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            listing = ", ".join(choices) if choices else "none (enable a plugin that provides one)"
            raise UnknownComponentError(f"{prefix}unknown {kind} '{name}'{hint}; choose one of: {listing}")
        return provided.spec

    def bind(self, ref: ComponentRef, ctx: Any = None, *, using: str | None = None) -> Any:
        """The component ``ref`` names, bound: a checked callable for a function kind, the object
        its factory builds for a factory kind (:func:`loongsage_core.binding.bind`, the one way
        anything a job names becomes callable or built)."""
        return binding.bind(self, ref, ctx, using=using)

    def check_arguments(self, ref: ComponentRef, *, using: str | None = None) -> None:
        """Whether ``ref``'s name resolves and its arguments bind, without building anything
        (what ``loongsage validate`` runs for every component)."""
        binding.check_arguments(self, ref, using=using)

    def provider(self, kind: str, name: str) -> str:
        """Name of the plugin providing ``kind`` ``name``."""
        self.get(kind, name)
        return self.index[kind][normalize_name(name)].plugin

    @staticmethod
    def _check_kind(kind: str) -> None:
        if kind not in KINDS:
            raise KeyError(f"unknown component kind '{kind}'; kinds: {', '.join(KINDS)}")

    def describe(self) -> dict[str, Any]:
        """The stable JSON listing of ``loongsage plugins --json``."""
        plugins = []
        for info in sorted(self.active_plugins(), key=lambda p: p.name):
            comps = {kind: sorted(n for n, p in self.index[kind].items() if p.plugin == info.name)
                     for kind in KINDS}
            plugins.append({"name": info.dist or info.name, "version": info.version,
                            "components": {k: v for k, v in comps.items() if v}})
        return {"hookspecs": list(KINDS), "plugins": plugins}

