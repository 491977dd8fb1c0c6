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
DOCS = (REPO / "docs" / "hooks.md").read_text()

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
    assert f"## `{hook}` — {kind}" in DOCS, f"docs/hooks.md has no section for {hook}"
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
    """Each protocol of ``loongsage_hookspecs.capabilities`` has a row in docs/hooks.md's table and
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
        assert f"| `{cap.__name__}` |" in DOCS, f"docs/hooks.md has no row for the capability {cap.__name__}"
        assert cap in declared or cap in per_trajectory, f"no shipped component declares {cap.__name__}"


FACTORY_FIELDS = ("factory", "sender", "receiver")
"""The spec fields of object-style kinds that hold what the host builds with."""


def test_every_object_style_kind_has_a_build_context():
    """``BUILD_CONTEXTS`` names the context of every ``(kind, factory field)`` the host builds:
    every key of ``BUILT_PROTOCOLS`` and every factory field of an object-style spec class, each a
    ``BuildContext`` (so every context carries ``where``, ``job`` and ``components``)."""
    from loongsage_hookspecs import BUILD_CONTEXTS, BUILT_PROTOCOLS, BuildContext

    assert set(BUILT_PROTOCOLS) <= set(BUILD_CONTEXTS), set(BUILT_PROTOCOLS) - set(BUILD_CONTEXTS)
    fields = {(kind, f.name) for kind, k in KINDS.items() for f in attrs.fields(k.spec) if f.name in FACTORY_FIELDS}
    assert fields == set(BUILD_CONTEXTS)
    for key, ctx in BUILD_CONTEXTS.items():
        assert isinstance(ctx, type) and issubclass(ctx, BuildContext), key
        assert attrs.has(ctx) and {"where", "job", "components"} <= {f.name for f in attrs.fields(ctx)}, key


def test_every_shipped_factory_takes_its_context_first():
    """One way to build a component: every shipped object-style spec's factory (all plugins
    enabled) is ``factory(ctx, **args)``, its first parameter a positional one, the context."""
    host = PluginHost.create()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    checked = []
    for kind in KINDS:
        for name, spec in host.components(kind).items():
            for field in FACTORY_FIELDS:
                factory = getattr(spec, field, None)
                if factory is None:
                    continue
                params = list(inspect.signature(factory).parameters.values())
                first = params[0] if params else None
                assert first is not None and first.kind in positional, (
                    f"{kind} '{name}' ({host.provider(kind, name)}): {field}{inspect.signature(factory)} does not "
                    "take the context as its first positional parameter")
                checked.append((kind, field))
    # the shipped plugins build every object-style kind, so each one was looked at
    from loongsage_hookspecs import BUILD_CONTEXTS

    assert set(checked) == set(BUILD_CONTEXTS), set(BUILD_CONTEXTS) - set(checked)
