"""Guards over the whole contract: every hook is documented, and for every hook a plugin that
implements it is discovered through an entry point, listed, and selected by name from a job file."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from loongsage_core.config import load_job
from loongsage_core.plugins import PluginHost
from loongsage_core.resolve import resolve_job
from loongsage_hookspecs import KINDS, hookspecs

REPO = Path(__file__).resolve().parent.parent
DOCS = (REPO / "docs" / "reference" / "hooks.md").read_text()

# the job-file key (override) that selects a component of each kind, and the resolved key it shows as
KIND_SELECTORS: dict[str, tuple[str, str]] = {
    "agent": ("data.0.agent", "data[0].agent"),
    "reward": ("data.0.reward", "data[0].reward[0]"),
    "data_source": ("data.0.generator", "data[0].generator"),
    "sandbox": ("data.0.sandbox", "data[0].sandbox"),
    "advantage": ("algorithm.advantage", "algorithm.advantage"),
    "policy_loss": ("algorithm.policy_loss", "algorithm.policy_loss"),
    "kl": ("algorithm.kl", "algorithm.kl"),
    "loss_aggregation": ("algorithm.loss_agg", "algorithm.loss_agg"),
    "correction": ("algorithm.corrections", "algorithm.corrections[0]"),
    "router_middleware": ("agentflow.middleware", "agentflow.middleware[0]"),
    "filter": ("algorithm.filters", "algorithm.filters[0]"),
    "scheduler": ("async.scheduler", "async.scheduler"),
    "teacher": ("teachers.0.backend", "teachers[0].backend"),
    "teacher_manager": ("placement.teacher_manager", "placement.teacher_manager"),
    "weight_transport": ("rollout.weight_transport", "rollout.weight_transport"),
    "logger": ("loggers.0.name", "loggers[0].name"),
    "train_backend": ("train.backend", "train.backend"),
    "rollout_engine": ("rollout.engine", "rollout.engine"),
    "engine_router": ("rollout.engine_router", "rollout.engine_router"),
}

LIST_KEYS = {"data.0.reward", "algorithm.corrections", "agentflow.middleware", "algorithm.filters"}


def test_every_kind_has_a_job_file_selector():
    assert set(KIND_SELECTORS) == set(KINDS)


@pytest.mark.parametrize("kind", list(KINDS))
def test_hook_is_documented(kind):
    hook = KINDS[kind].hook
    fn = getattr(hookspecs, hook)
    doc = inspect.getdoc(fn) or ""
    assert "Example" in doc and len(doc) > 80, f"{hook} needs a docstring with an example"
    assert f"## `{hook}` — {kind}" in DOCS, f"docs/reference/hooks.md has no section for {hook}"
    assert f"| `{kind}` | `{hook}` |" in DOCS


def contract_module(kind: str) -> str:
    spec_cls = KINDS[kind].spec
    required = [f.name for f in attrs.fields(spec_cls) if f.default is attrs.NOTHING and f.name != "name"]
    args = ", ".join(f"{name}=_callable" for name in required)
    return (
        "from loongsage_hookspecs import hookimpl, " + spec_cls.__name__ + "\n"
        "def _callable(*args, **kwargs):\n    return None\n"
        "@hookimpl\n"
        f"def {KINDS[kind].hook}():\n"
        f"    return [{spec_cls.__name__}(name='Contract-{kind}', description='contract probe', {args})]\n"
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_plugin_for_every_hook_is_discovered_listed_and_selected(kind, install_plugin, tmp_path):
    install_plugin(f"loongsage-plugin-contract-{kind.replace('_', '-')}", f"contract_{kind}",
                   f"ls_contract_{kind}", contract_module(kind))
    # listed by the CLI (a real subprocess sees the installed dist-info through PYTHONPATH)
    site = next(p for p in sys.path if p.endswith("site") and Path(p, f"ls_contract_{kind}.py").exists())
    env = {"PYTHONPATH": site, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "loongsage_core", "plugins", "--json"], capture_output=True,
                         text=True, env=env, check=True)
    listing = json.loads(out.stdout)
    (entry,) = [p for p in listing["plugins"] if p["name"] == f"loongsage-plugin-contract-{kind.replace('_', '-')}"]
    assert entry["components"] == {kind: [f"contract_{kind}"]}

    # selected by name from a job file
    job_path = tmp_path / "job.toml"
    source = "" if kind == "data_source" else 'path = "rows.jsonl"\n'
    job_path.write_text(f'[[data]]\nname = "d"\n{source}[[teachers]]\nname = "t"\n')
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1="}\n')  # validated as the run would read it
    key, shown = KIND_SELECTORS[kind]
    value = f'["contract-{kind}"]' if key in LIST_KEYS else f"contract-{kind}"
    overrides = [f"{key}={value}"]
    if kind == "scheduler":
        overrides.append("async.enable=true")
    job = load_job(job_path, overrides)
    host = PluginHost.create()
    resolved_kind, name, plugin = resolve_job(job, host).components[shown]
    assert (resolved_kind, name) == (kind, f"contract-{kind}")
    assert plugin == f"contract_{kind}"
    assert host.get(kind, name).description == "contract probe"


def test_every_capability_is_documented_and_declared_by_a_shipped_component():
    """Each protocol of ``loongsage_hookspecs.capabilities`` has a row in docs/reference/hooks.md's table and
    is declared by at least one shipped spec (a capability nobody has is dead contract)."""
    from loongsage_core.plugins import PluginHost
    from loongsage_hookspecs import CheckpointableScheduler, capabilities, is_capability

    caps = [c for c in vars(capabilities).values() if is_capability(c) and c.__module__ == capabilities.__name__]
    caps.append(CheckpointableScheduler)
    assert len(caps) >= 14
    host = PluginHost.create()
    declared = {c for kind in KINDS for spec in host.components(kind).values() for c in spec.declared_capabilities()}
    # a sandbox's, checked where agents use it: providers create sandboxes per trajectory, no spec builds one
    per_trajectory = {capabilities.RunsPrograms}
    for cap in caps:
        assert f"| `{cap.__name__}` |" in DOCS, f"docs/reference/hooks.md has no row for the capability {cap.__name__}"
        assert cap in declared or cap in per_trajectory, f"no shipped component declares {cap.__name__}"


CALLABLE_FIELDS = ("fn", "factory", "sender", "receiver")
"""The spec fields that hold what the host calls: a function kind's ``fn``, a factory kind's
``factory`` (a weight transport's ``sender`` and ``receiver``)."""


def test_every_kind_record_says_how_each_callable_of_its_spec_is_called():
    """A kind's :class:`~loongsage_hookspecs.Call` records are exactly its spec class's callable
    fields; a factory's context is a ``BuildContext`` (so every context carries ``where``, ``job``
    and ``components``) and a function has no context; both the spec's class and the hook agree."""
    from loongsage_hookspecs import BuildContext, kind_of

    for kind, record in KINDS.items():
        fields = {f.name for f in attrs.fields(record.spec) if f.name in CALLABLE_FIELDS}
        assert {c.field for c in record.calls} == fields, kind
        for call in record.calls:
            if call.field == "fn":
                assert call.context is None and call.protocol is None and call.inputs >= 1, kind
            else:
                assert isinstance(call.context, type) and issubclass(call.context, BuildContext), kind
                assert attrs.has(call.context) and {"where", "job", "components"} <= {
                    f.name for f in attrs.fields(call.context)}, kind
        assert hasattr(hookspecs, record.hook), kind
        probe = record.spec(name="probe", **{f: (lambda *a, **k: None) for f in fields if f != "receiver"})
        assert kind_of(probe) is record


def test_every_shipped_callable_takes_what_its_kind_passes_first():
    """One way to call a component: every shipped spec's callables (all plugins enabled) take the
    kind's leading positional inputs, the context for a factory (``factory(ctx, **args)``) and
    the inputs for a function (``fn(*inputs, **args)``)."""
    host = PluginHost.create()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    checked = set()
    for kind, record in KINDS.items():
        for name, spec in host.components(kind).items():
            for call in record.calls:
                target = getattr(spec, call.field)
                if target is None:
                    continue
                params = list(inspect.signature(target).parameters.values())
                leading = [p for p in params if p.kind in positional][:call.positional]
                star = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
                assert len(leading) == call.positional or star, (
                    f"{kind} '{name}' ({host.provider(kind, name)}): {call.field}{inspect.signature(target)} does "
                    f"not take the {call.positional} leading positional input(s) the host passes")
                checked.add((kind, call.field))
    # the shipped plugins provide every kind, so each call of each was looked at
    assert checked == {(k, c.field) for k, r in KINDS.items() for c in r.calls}


LIBRARY_DIRS = ("loongsage_core", "hookspecs/loongsage_hookspecs", *(
    str(p.relative_to(REPO)) for p in sorted((REPO / "plugins").glob("loongsage-plugin-*/loongsage_plugin_*"))))
BINDER = REPO / "loongsage_core" / "binding.py"


def spec_calls(path: Path) -> list[str]:
    """The places in ``path`` that call a spec's callable field directly (``x.fn(...)``,
    ``x.factory(...)``, ``x.sender(...)``, ``x.receiver(...)``, or ``getattr(x, "fn")(...)``)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in CALLABLE_FIELDS:
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: .{func.attr}(...)")
        elif (isinstance(func, ast.Call) and isinstance(func.func, ast.Name) and func.func.id == "getattr"
              and len(func.args) >= 2 and isinstance(func.args[1], ast.Constant)
              and func.args[1].value in CALLABLE_FIELDS):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: getattr(..., {func.args[1].value!r})(...)")
    return found


def test_no_spec_callable_is_called_outside_the_binder():
    """Everything a job names becomes callable or built through ``loongsage_core.binding`` alone:
    no library module of the host, the contract or a plugin calls a spec's ``fn``, ``factory``,
    ``sender`` or ``receiver`` itself (the binder's argument binding, error mapping and protocol
    checks would be skipped)."""
    offenders = [hit for d in LIBRARY_DIRS for path in sorted((REPO / d).rglob("*.py")) if path != BINDER
                 for hit in spec_calls(path)]
    assert offenders == []


def test_the_guard_sees_a_direct_call(tmp_path):
    """The guard above would fail on a module that calls a spec's callable (so its silence means
    something)."""
    planted = REPO / "loongsage_core" / "_planted_spec_call_probe.py"
    planted.write_text("def use(spec, ctx, inputs):\n    spec.factory(ctx)\n    return getattr(spec, 'fn')(inputs)\n")
    try:
        assert len(spec_calls(planted)) == 2
    finally:
        planted.unlink()
