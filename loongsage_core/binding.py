"""The binder: the one way a component a job names becomes callable or built.

:func:`bind` takes a :class:`~loongsage_hookspecs.ComponentRef` (kind, name, the job's arguments
and the keys that named them) and the kind's record in :data:`~loongsage_hookspecs.KINDS`, and

* for a **function** kind (reward, advantage, policy loss, ...) returns a :class:`BoundFunction`:
  the spec's function with the job's arguments bound, called with the kind's inputs;
* for a **factory** kind (agent, logger, backend, transport, ...) calls the factory with the
  kind's context and the arguments, and checks that what it built implements the kind's protocol
  and the capabilities its spec declares.

Arguments are bound one way for every kind (:func:`bind_arguments`): structured into the spec's
``args_schema`` when it declares one, else checked against the callable's own signature (its
keyword parameters after the inputs or the context, their annotations as types, their defaults),
with the job file's strict typing. Errors are mapped one way: an unknown name lists the choices,
an argument the component does not take or a value it refuses is a
:class:`~loongsage_core.config.ConfigError` naming the ``*_args`` key, anything else a factory
raises is a :class:`~loongsage_core.errors.ComponentBuildError` naming the component and its
plugin. Nothing else in the host or the plugins calls a spec's callables (a guard test checks).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Mapping, Protocol

import attrs

from loongsage_hookspecs import KINDS, Call, ComponentRef, ComponentSpec, Kind, missing_members

from .config import ConfigError, structure_args, structure_value
from .errors import ComponentBuildError, PluginError

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class SpecSource(Protocol):
    """Where the binder finds specs: the plugin host (:class:`loongsage_core.plugins.PluginHost`)."""

    def get(self, kind: str, name: str, where: str | None = None) -> Any: ...

    def provider(self, kind: str, name: str) -> str: ...


class BoundFunction:
    """A function-kind component with the job's arguments bound: ``bound(*inputs)`` calls the
    spec's function as ``fn(*inputs, **args)``. Keywords at call time are only the ones the host
    fills itself (the kind's ``reserved``: a reward's ``sandbox``). ``spec`` is the component's
    spec (its declarations: ``needs_sandbox``, ``stage``, ``requires``, ...)."""

    __slots__ = ("ref", "spec", "plugin", "call", "kwargs")

    def __init__(self, ref: ComponentRef, spec: ComponentSpec, plugin: str, call: Call,
                 kwargs: Mapping[str, Any]) -> None:
        self.ref = ref
        self.spec = spec
        self.plugin = plugin
        self.call = call
        self.kwargs = dict(kwargs)

    @property
    def name(self) -> str:
        """The component's (normalised) name."""
        return self.spec.name

    def __call__(self, *inputs: Any, **host: Any) -> Any:
        extra = set(host) - set(self.call.reserved)
        if extra:
            raise TypeError(f"{self.ref.kind} '{self.name}': the host passes only {list(self.call.reserved)} at "
                            f"call time, not {sorted(extra)}")
        return getattr(self.spec, self.call.field)(*inputs, **self.kwargs, **host)

    def __repr__(self) -> str:
        return f"BoundFunction({self.ref.kind} {self.name!r}, args={self.kwargs!r})"


@attrs.define(frozen=True)
class Parameter:
    """One keyword argument a component takes: its name, type and whether a job must give it."""

    name: str
    type: Any
    required: bool


def signature_parameters(fn: Callable[..., Any], call: Call) -> list[Parameter] | None:
    """The keyword arguments ``fn`` takes from a job (after its ``call.positional`` leading
    positional parameters, less the reserved ones), with their annotated types; ``None`` when it
    takes any keyword (``**kwargs``) or has no readable signature."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    out: list[Parameter] = []
    skipped = 0
    for p in params:
        if p.kind in _POSITIONAL and skipped < call.positional:
            skipped += 1
            continue
        if p.kind in _KEYWORD and p.name not in call.reserved:
            out.append(Parameter(p.name, _annotation(fn, p.annotation), p.default is inspect.Parameter.empty))
    return out


def _annotation(fn: Callable[..., Any], annotation: Any) -> Any:
    """A parameter's annotation as a type (``Any`` when there is none or it does not resolve, e.g.
    a name imported for type checking only)."""
    if annotation is inspect.Parameter.empty:
        return Any
    if isinstance(annotation, str):
        target = inspect.unwrap(fn)
        module = sys.modules.get(getattr(target, "__module__", "") or "")
        # a function's own globals, or a class's module (its __init__'s annotations are text there)
        namespace = dict(getattr(target, "__globals__", None) or (vars(module) if module else {}))
        try:
            return eval(annotation, namespace)  # noqa: S307 - the plugin's own annotation text
        except Exception:
            return Any
    return annotation


def schema_parameters(schema: type) -> list[Parameter]:
    """The fields of an ``args_schema`` attrs class as :class:`Parameter` values."""
    return [Parameter(f.name, f.type, f.default is attrs.NOTHING) for f in attrs.fields(schema)]


def accepted_parameters(spec: ComponentSpec, call: Call) -> list[Parameter] | None:
    """What a job may give the component: its ``args_schema``'s fields, else its callable's keyword
    parameters, or, for a callable that passes ``**kwargs`` on, those of the class its spec names
    in ``args_from``; ``None``: any keyword."""
    if spec.args_schema is not None:
        return schema_parameters(spec.args_schema)
    params = signature_parameters(getattr(spec, call.field), call)
    if params is None and spec.args_from is not None and call.field != "receiver":
        return signature_parameters(import_target(spec.args_from), Call("args_from"))
    return params


def import_target(path: str) -> Callable[..., Any]:
    """The object ``"module:Name"`` names (a component's ``args_from``); a path that does not
    import is the plugin's own bug, reported as such."""
    import importlib

    module, _, name = path.partition(":")
    try:
        target: Any = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"args_from {path!r} does not import: {type(exc).__name__}: {exc}") from None
    return target


def bind_arguments(spec: ComponentSpec, call: Call, ref: ComponentRef) -> dict[str, Any]:
    """The keywords the component is called with for the job's ``ref.args``; a
    :class:`ConfigError` naming ``ref.args_key`` for an unknown key, a missing required argument
    or a value of the wrong type or range."""
    what = f"{ref.kind.replace('_', ' ')} '{spec.name}'"
    args = dict(ref.args)
    params = accepted_parameters(spec, call)
    if params is None:  # takes any keyword
        return args
    by_name = {p.name: p for p in params}
    for key in args:
        if key not in by_name:
            listing = ", ".join(by_name) or "none"
            raise ConfigError(f"{ref.args_key}.{key}: unknown argument of {what}; it takes: {listing}")
    missing = [p.name for p in params if p.required and p.name not in args]
    if missing:
        raise ConfigError(f"{ref.args_key}: {what} needs the argument(s) {', '.join(missing)}")
    if spec.args_schema is not None:  # the schema's types and validators; every field is passed
        try:
            instance: Any = structure_args(spec.args_schema, args, ref.args_key, what)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return {f.name: getattr(instance, f.name) for f in attrs.fields(spec.args_schema)}
    bound: dict[str, Any] = {}
    for key, value in args.items():
        try:
            bound[key] = structure_value(value, by_name[key].type)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{ref.args_key}.{key}: {exc} (an argument of {what})") from None
    return bound


def kind_record(kind: str) -> Kind:
    """The :class:`~loongsage_hookspecs.Kind` called ``kind``; another word is the host's own bug."""
    record = KINDS.get(kind)
    if record is None:
        raise KeyError(f"unknown component kind '{kind}'; kinds: {', '.join(KINDS)}")
    return record


def check_arguments(host: SpecSource, ref: ComponentRef, *, using: str | None = None) -> None:
    """What ``loongsage validate`` runs for every component: the name resolves and the arguments
    bind (:func:`bind_arguments`), without calling or building anything."""
    call = kind_record(ref.kind).call(using)
    bind_arguments(host.get(ref.kind, ref.name, where=ref.where), call, ref)


def bind(host: SpecSource, ref: ComponentRef, ctx: Any = None, *, using: str | None = None) -> Any:
    """The component ``ref`` names: a :class:`BoundFunction` for a function kind, the object its
    factory builds for a factory kind (``ctx``: an instance of the kind's context class;
    ``using``: which factory of a kind with several). See the module docstring for the errors."""
    call = kind_record(ref.kind).call(using)
    spec = host.get(ref.kind, ref.name, where=ref.where)
    kwargs = bind_arguments(spec, call, ref)
    plugin = host.provider(ref.kind, ref.name)
    if not call.is_factory:
        if ctx is not None:
            raise TypeError(f"bind: {ref.kind} '{ref.name}' is a function; it takes no context")
        return BoundFunction(ref, spec, plugin, call, kwargs)
    assert call.context is not None
    if not isinstance(ctx, call.context):
        raise TypeError(f"bind: {ref.kind} '{ref.name}' needs a {call.context.__name__} as its context, got "
                        f"{type(ctx).__name__}")
    factory = getattr(spec, call.field)
    refused = f"{ref.args_key}: {ref.kind} '{ref.name}' does not take these arguments"
    try:
        built = factory(ctx, **kwargs)
    except (ConfigError, PluginError):
        raise
    except ValueError as exc:  # a value the factory refuses: the arguments' table is at fault
        raise ConfigError(f"{ref.args_key}: {exc}") from exc
    except Exception as exc:
        # a factory that passes ``**kwargs`` on (to a class, say) meets the argument it does not
        # take one call deeper: still the job's argument, when the error names one it passed
        if isinstance(exc, TypeError) and any(f"unexpected keyword argument '{key}'" in str(exc) for key in kwargs):
            raise ConfigError(f"{refused}: {exc}") from None
        raise ComponentBuildError(f"{ref.where}: building {ref.kind} '{ref.name}' (plugin {plugin}) failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
    check_built(ref, spec, call, built, plugin)
    return built


def check_built(ref: ComponentRef, spec: ComponentSpec, call: Call, built: Any, plugin: str) -> None:
    """The built object implements its kind's protocol and every capability its spec declares
    (:mod:`loongsage_hookspecs.capabilities`), else a :class:`ComponentBuildError` naming what it
    lacks: a plugin's mistake shows when the component is built, not mid-run."""
    wanted: list[tuple[type, str]] = []
    if call.protocol is not None:
        wanted.append((call.protocol, f"the {ref.kind} protocol {call.protocol.__name__}"))
    if call.field != "receiver":  # a weight transport's capabilities are its sender's
        wanted += [(cap, f"the capability {cap.__name__} its spec declares") for cap in spec.declared_capabilities()]
    for proto, what in wanted:
        missing = missing_members(built, proto)
        if missing:
            raise ComponentBuildError(f"{ref.where}: {ref.kind} '{ref.name}' (plugin {plugin}) built a "
                                      f"{type(built).__name__} that lacks {', '.join(missing)} of {what}")
