"""Plugin discovery, selection, blocking and conflicts with real installed distributions."""

from __future__ import annotations

import sys
import warnings

import pytest

from loongsage_core.errors import ConflictError, PluginError, UnknownComponentError
from loongsage_core.plugins import DISABLE_ENV, PluginHost, PluginWarning
from loongsage_hookspecs import ComponentRef, LoggerContext

GOOD = '''
from loongsage_hookspecs import hookimpl, RewardSpec, AdvantageSpec

@hookimpl
def loongsage_rewards():
    yield RewardSpec(name="Always-One", fn=lambda traj: 1.0, description="constant one")

@hookimpl
def loongsage_advantages():
    yield AdvantageSpec(name="zero_adv", fn=lambda inputs: None, description="zeros")
'''

CLASHING = '''
from loongsage_hookspecs import hookimpl, RewardSpec

@hookimpl
def loongsage_rewards():
    yield RewardSpec(name="always_one", fn=lambda traj: 2.0)
'''

BROKEN = '''
raise RuntimeError("this plugin cannot be imported")
'''

MISSPELLED = '''
from loongsage_hookspecs import hookimpl

@hookimpl
def loongsage_reward():
    return []
'''


def test_installed_plugin_is_discovered_listed_and_selected(install_plugin):
    install_plugin("loongsage-plugin-dummy", "dummy", "ls_dummy_good", GOOD)
    host = PluginHost.create(enable=["dummy"])
    assert host.get("reward", "always_one").fn(None) == 1.0
    # names are normalised: case and dashes do not matter
    assert host.get("reward", "ALWAYS-ONE").name == "always_one"
    listing = host.describe()
    (entry,) = [p for p in listing["plugins"] if p["name"] == "loongsage-plugin-dummy"]
    assert entry["version"] == "0.3.1"
    assert entry["components"] == {"reward": ["always_one"], "advantage": ["zero_adv"]}


def test_enable_accepts_distribution_and_short_names(install_plugin):
    install_plugin("loongsage-plugin-dummy", "dummy", "ls_dummy_good", GOOD)
    for name in ("loongsage-plugin-dummy", "dummy", "Loongsage_Plugin_Dummy"):
        assert "always_one" in PluginHost.create(enable=[name]).components("reward")


def test_only_enabled_plugins_provide_components(install_plugin):
    install_plugin("loongsage-plugin-dummy", "dummy", "ls_dummy_good", GOOD)
    host = PluginHost.create(enable=["rl"])
    assert "always_one" not in host.components("reward")
    with pytest.raises(UnknownComponentError, match="unknown reward 'always_one'"):
        host.get("reward", "always_one")


def test_unknown_component_lists_choices_with_hint(install_plugin):
    install_plugin("loongsage-plugin-dummy", "dummy", "ls_dummy_good", GOOD)
    host = PluginHost.create(enable=["dummy"])
    with pytest.raises(UnknownComponentError) as err:
        host.get("reward", "always_on", where="job.toml: data[0].reward[0]")
    msg = str(err.value)
    assert msg.startswith("job.toml: data[0].reward[0]: unknown reward 'always_on'")
    assert "did you mean 'always_one'" in msg and "choose one of: always_one" in msg


def test_duplicate_component_names_name_both_providers(install_plugin):
    install_plugin("loongsage-plugin-dummy", "dummy", "ls_dummy_good", GOOD)
    install_plugin("loongsage-plugin-clash", "clash", "ls_dummy_clash", CLASHING)
    host = PluginHost.create(enable=["dummy", "clash"])
    with pytest.raises(ConflictError, match="reward 'always_one' provided by 'dummy' and 'clash'|"
                                            "reward 'always_one' provided by 'clash' and 'dummy'"):
        host.components("reward")


def test_named_broken_plugin_is_a_hard_error(install_plugin):
    install_plugin("loongsage-plugin-broken", "broken", "ls_dummy_broken", BROKEN)
    with pytest.raises(PluginError, match="plugin 'loongsage-plugin-broken' is enabled but broken.*cannot be imported"):
        PluginHost.create(enable=["broken"])


def test_unnamed_broken_plugin_is_a_warning_and_others_still_work(install_plugin):
    install_plugin("loongsage-plugin-broken", "broken", "ls_dummy_broken", BROKEN)
    install_plugin("loongsage-plugin-dummy", "dummy", "ls_dummy_good", GOOD)
    with pytest.warns(PluginWarning, match="skipping plugin 'loongsage-plugin-broken'"):
        host = PluginHost.create()  # every installed plugin is imported
    assert host.get("reward", "always_one").fn(None) == 1.0
    assert "loongsage-plugin-broken" in host.skipped


def test_a_plugin_the_job_does_not_enable_is_not_imported(install_plugin):
    install_plugin("loongsage-plugin-broken", "broken", "ls_dummy_broken", BROKEN)
    install_plugin("loongsage-plugin-dummy", "dummy", "ls_dummy_good", GOOD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the broken plugin is never imported, so nothing warns
        host = PluginHost.create(enable=["dummy"])
    assert host.get("reward", "always_one").fn(None) == 1.0
    assert "ls_dummy_broken" not in sys.modules and not host.skipped
    assert "broken" in host.installed_names()  # still known, from its metadata


def test_missing_plugin_lists_what_is_installed(install_plugin):
    install_plugin("loongsage-plugin-dummy", "dummy", "ls_dummy_good", GOOD)
    with pytest.raises(PluginError) as err:
        PluginHost.create(enable=["dumy"])
    assert "plugin 'dumy' is not installed" in str(err.value)
    assert "did you mean 'dummy'" in str(err.value)
    assert "installed: " in str(err.value) and "dummy" in str(err.value)


def test_misspelled_hook_fails_loudly(install_plugin):
    install_plugin("loongsage-plugin-typo", "typo", "ls_dummy_typo", MISSPELLED)
    with pytest.raises(PluginError, match="unknown hook 'loongsage_reward'"):
        PluginHost.create(enable=["typo"])


def test_env_var_blocks_plugin_before_import(install_plugin, monkeypatch):
    install_plugin("loongsage-plugin-broken", "broken", "ls_dummy_broken", BROKEN)
    install_plugin("loongsage-plugin-dummy", "dummy", "ls_dummy_good", GOOD)
    monkeypatch.setenv(DISABLE_ENV, "broken, dummy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the broken plugin must not even be imported
        host = PluginHost.create()
    assert host.skipped["loongsage-plugin-broken"].startswith("blocked")
    assert "always_one" not in host.components("reward")
    with pytest.raises(PluginError, match=f"plugin 'dummy' is enabled but blocked by {DISABLE_ENV}"):
        PluginHost.create(enable=["dummy"])


def test_user_module_by_path(tmp_path):
    mod = tmp_path / "my_hooks.py"
    mod.write_text(GOOD)
    host = PluginHost.create(enable=[], modules=["my_hooks.py"], base_dir=tmp_path)
    assert host.provider("reward", "always_one") == "module:my_hooks"


def test_user_module_missing_or_raising(tmp_path):
    with pytest.raises(PluginError, match=r"modules\[0\]: user module 'nope.py' not found"):
        PluginHost.create(modules=["nope.py"], base_dir=tmp_path)
    (tmp_path / "bad.py").write_text("1/0\n")
    with pytest.raises(PluginError, match=r"modules\[0\]: importing .*bad.py' failed: ZeroDivisionError"):
        PluginHost.create(modules=["bad.py"], base_dir=tmp_path)


def test_hook_returning_wrong_spec_type_is_rejected(tmp_path):
    (tmp_path / "wrong.py").write_text(
        "from loongsage_hookspecs import hookimpl, RewardSpec\n"
        "@hookimpl\ndef loongsage_advantages():\n    return [RewardSpec(name='x', fn=len)]\n")
    host = PluginHost.create(modules=["wrong.py"], base_dir=tmp_path)
    with pytest.raises(PluginError, match="loongsage_advantages returned RewardSpec, expected AdvantageSpec"):
        host.components("advantage")


def test_the_plugin_host_is_the_registry_the_contract_hands_to_backends():
    from loongsage_hookspecs import ComponentRegistry

    host = PluginHost.create(enable=["rl"])
    assert isinstance(host, ComponentRegistry)
    assert host.get("advantage", "grpo") is host.components("advantage")["grpo"]


OUT = LoggerContext(output_dir="out", total_steps=1)

BUILDERS = '''
from loongsage_hookspecs import hookimpl, LoggerSpec


class Fine:
    def __init__(self, ctx, every=1):
        self.output_dir, self.every = ctx.output_dir, every

    def log(self, step, metrics):
        pass

    def close(self):
        pass


def refuses(ctx, every=1):
    raise ValueError(f"every = {every} must be positive")


def buggy(ctx):
    return len(ctx.output_dir, 2)  # a TypeError inside the factory: its bug, not the job's


def broken(ctx):
    raise OSError("disk full")


@hookimpl
def loongsage_loggers():
    return [LoggerSpec(name=n, factory=f) for n, f in
            (("fine", Fine), ("refuses", refuses), ("buggy", buggy), ("broken", broken))]
'''


def test_bind_is_the_one_way_components_are_made_and_fail(tmp_path):
    """``PluginHost.bind``: arguments the factory does not take and refused values are job errors
    naming the arguments' key; a factory's own failure (even a ``TypeError`` inside it) is a run
    error naming the key, the component and its plugin, chained to the cause."""
    from loongsage_core.config import ConfigError
    from loongsage_core.errors import ComponentBuildError, RunError

    (tmp_path / "builders.py").write_text(BUILDERS)
    host = PluginHost.create(enable=[], modules=["builders.py"], base_dir=tmp_path)
    where, args_key = "job.toml: loggers[0].name", "job.toml: loggers[0].args"

    def ref(name, **args):
        return ComponentRef("logger", name, args, where=where, args_where=args_key)

    made = host.bind(ref("fine", every=3), OUT)
    assert (made.output_dir, made.every) == ("out", 3)
    with pytest.raises(UnknownComponentError, match=r"job.toml: loggers\[0\].name: unknown logger 'fin' "
                                                    r"\(did you mean 'fine'\?\)"):
        host.bind(ref("fin"), OUT)
    with pytest.raises(ConfigError, match=r"^job.toml: loggers\[0\].args.evry: unknown argument of logger 'fine'; "
                                          r"it takes: every$"):
        host.bind(ref("fine", evry=3), OUT)
    with pytest.raises(ConfigError, match=r"^job.toml: loggers\[0\].args: every = 0 must be positive$"):
        host.bind(ref("refuses", every=0), OUT)
    with pytest.raises(ComponentBuildError, match=r"^job.toml: loggers\[0\].name: building logger 'buggy' \(plugin "
                                                  r"module:builders\) failed: TypeError: ") as bug:
        host.bind(ref("buggy"), OUT)
    assert isinstance(bug.value, RunError) and isinstance(bug.value.__cause__, TypeError)
    with pytest.raises(ComponentBuildError, match="building logger 'broken' .* failed: OSError: disk full"):
        host.bind(ref("broken"), OUT)


def test_bind_passes_the_kinds_context_and_refuses_another(tmp_path):
    """``factory(ctx, **args)``: the host's context goes first; a context of another class (or
    none) is the host's own bug, a ``TypeError`` naming the kind and the class it needs, before
    the factory runs."""
    from loongsage_hookspecs import BuildContext

    (tmp_path / "builders.py").write_text(BUILDERS)
    host = PluginHost.create(enable=[], modules=["builders.py"], base_dir=tmp_path)
    fine = ComponentRef("logger", "fine", where="w")
    assert host.bind(fine, OUT).output_dir == "out"
    for bad in ("out", BuildContext(), None):
        with pytest.raises(TypeError, match=r"^bind: logger 'fine' needs a LoggerContext as its context, got "):
            host.bind(fine, bad)
    with pytest.raises(TypeError):  # one positional input: the context
        host.bind(fine, OUT, "extra")  # type: ignore[misc]


CAPABLE = BUILDERS + '''

class Silent:  # no close(): not a MetricsLogger
    def __init__(self, ctx):
        pass

    def log(self, step, metrics):
        pass


class Truncating(Fine):
    def truncate_after(self, step):
        self.truncated = step


@hookimpl
def loongsage_loggers():  # replaces the BUILDERS hook above: only these three are provided
    from loongsage_hookspecs import StepTruncation
    return [LoggerSpec(name="silent", factory=Silent),
            LoggerSpec(name="claims", factory=Fine, capabilities=(StepTruncation,)),
            LoggerSpec(name="truncating", factory=Truncating, capabilities=[StepTruncation])]
'''


def test_bind_checks_the_kinds_protocol_and_the_declared_capabilities(tmp_path):
    """What a factory builds implements its kind's protocol and every capability its spec
    declares, or the build fails naming the missing members (not an AttributeError mid-run)."""
    from loongsage_core.errors import ComponentBuildError
    from loongsage_hookspecs import LoggerSpec, Offloadable, StepTruncation

    (tmp_path / "capable.py").write_text(CAPABLE)
    host = PluginHost.create(enable=[], modules=["capable.py"], base_dir=tmp_path)
    with pytest.raises(ComponentBuildError, match=r"^w: logger 'silent' \(plugin module:capable\) built a Silent "
                                                  r"that lacks close of the logger protocol MetricsLogger$"):
        host.bind(ComponentRef("logger", "silent", where="w"), OUT)
    with pytest.raises(ComponentBuildError, match=r"built a Fine that lacks truncate_after of the capability "
                                                  r"StepTruncation its spec declares$"):
        host.bind(ComponentRef("logger", "claims", where="w"), OUT)
    made = host.bind(ComponentRef("logger", "truncating", where="w"), OUT)
    spec = host.get("logger", "truncating")
    assert spec.capabilities == (StepTruncation,) and spec.declares(StepTruncation) and not spec.declares(Offloadable)
    assert isinstance(made, StepTruncation)
    with pytest.raises(TypeError, match="capabilities: .*are not capability protocols"):
        LoggerSpec(name="bad", factory=dict, capabilities=(dict,))


def test_shipped_components_declare_what_their_objects_do():
    """Each shipped spec's declared capabilities, where its objects are cheap to build here."""
    from loongsage_hookspecs import (
        Closeable,
        LoraTrainer,
        ObservingMiddleware,
        ReplaceableEngines,
        ResidentTeacher,
        ReusesTrainingLogprobs,
        SharesPrompts,
        SourcePicker,
        StepTruncation,
        StreamingMiddleware,
        TrajectoryLogger,
    )

    host = PluginHost.create()
    expected = {("logger", "console"): TrajectoryLogger, ("logger", "wandb"): TrajectoryLogger,
                ("logger", "jsonl"): StepTruncation, ("logger", "tensorboard"): StepTruncation,
                ("scheduler", "window_gated"): SourcePicker, ("engine_router", "sglang_router"): ReplaceableEngines,
                ("teacher", "torch"): ResidentTeacher, ("sandbox", "local"): Closeable,
                ("router_middleware", "tool_call_parser"): StreamingMiddleware,
                ("router_middleware", "request_logger"): ObservingMiddleware,
                ("train_backend", "torch"): LoraTrainer, ("train_backend", "megatron"): LoraTrainer}
    for (kind, name), capability in expected.items():
        assert host.get(kind, name).declares(capability), (kind, name, capability)
    assert not host.get("train_backend", "megatron").declares(ReusesTrainingLogprobs)
    assert host.get("train_backend", "torch").declares(SharesPrompts)
    assert not host.get("train_backend", "megatron").declares(SharesPrompts)


def test_bind_names_an_argument_a_factory_passed_on_as_the_jobs(tmp_path):
    """A factory taking ``**args`` and passing them on meets an unknown one a call deeper: that
    ``TypeError`` is still the job's argument (an unexpected keyword it passed)."""
    from loongsage_core.config import ConfigError

    passes_on = '(("passes_on", lambda ctx, **args: Fine(ctx, **args)),'
    passing = BUILDERS.replace('(("fine", Fine),', passes_on)
    (tmp_path / "passing.py").write_text(passing)
    host = PluginHost.create(enable=[], modules=["passing.py"], base_dir=tmp_path)
    assert host.bind(ComponentRef("logger", "passes_on", {"every": 2}, where="w"), OUT).every == 2
    with pytest.raises(ConfigError, match=r"^a: logger 'passes_on' does not take these arguments: .*'evry'"):
        host.bind(ComponentRef("logger", "passes_on", {"evry": 2}, where="w", args_where="a"), OUT)


def test_register_specs_adds_selectable_components_to_a_real_host():
    """``register_specs``: a test's own specs beside the real plugins, selectable and built the same
    way; a name an enabled plugin already provides is a conflict, a non-spec a TypeError."""
    from loongsage_core.errors import ConflictError
    from loongsage_hookspecs import AggregationSpec, PolicyLossSpec

    host = PluginHost.create(enable=["rl"])
    host.register_specs(PolicyLossSpec(name="My-Loss", fn=lambda inputs: None), name="module:mine")
    assert host.get("policy_loss", "my_loss").name == "my_loss"
    assert host.provider("policy_loss", "my_loss") == "module:mine"
    assert "ppo_clip" in host.components("policy_loss")
    host.register_specs(AggregationSpec(name="token_mean", fn=lambda loss, mask, norm: loss), name="module:dup")
    with pytest.raises(ConflictError, match="loss_aggregation 'token_mean' provided by"):
        host.components("loss_aggregation")
    with pytest.raises(TypeError, match="is not a spec of any component kind"):
        host.register_specs(object())
