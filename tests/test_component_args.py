"""Component arguments checked at validate time against each component's signature or schema, the
way the binder binds them at run time (keys, required arguments, types and ranges)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from loongsage_core.binding import Parameter, signature_parameters
from loongsage_core.component_args import check_component_args, check_effective_settings
from loongsage_core.config import ConfigError, structure_job
from loongsage_core.plugins import PluginHost


def job(**tables):
    raw = {"plugins": {"enable": ["torch", "rl", "rewards", "agents", "schedulers", "loggers"]},
           "data": [{"name": "a", "generator": "arithmetic", "reward": ["exact_match"]}]}
    for key, value in tables.items():
        raw.setdefault(key, {}) if not isinstance(value, list) else None
        if isinstance(value, dict):
            raw[key].update(value)
        else:
            raw[key] = value
    return structure_job(raw, source="job.toml")


@pytest.fixture(scope="module")
def host():
    return PluginHost.from_job(job())


def test_signature_gives_the_keywords_a_job_may_set_with_their_types():
    from loongsage_hookspecs import KINDS

    def reward(trajectory, *, pattern: str, mode="search", sandbox=None):
        return 0.0

    def loose(trajectory, **kwargs):
        return 0.0

    def aggregation(loss, mask, norm, scale: float = 1.0):
        return loss

    def factory(ctx, window: int = 2):
        return None

    assert signature_parameters(reward, KINDS["reward"].call()) == [
        Parameter("pattern", str, True), Parameter("mode", Any, False)]  # sandbox: the host's own keyword
    assert signature_parameters(loose, KINDS["reward"].call()) is None  # takes any keyword
    assert signature_parameters(aggregation, KINDS["loss_aggregation"].call()) == [Parameter("scale", float, False)]
    assert signature_parameters(factory, KINDS["scheduler"].call()) == [Parameter("window", int, False)]


@pytest.mark.parametrize("tables, message", [
    ({"data": [{"name": "a", "generator": "arithmetic", "reward": ["exact_match"],
                "reward_args": {"exact_match": {"case_sensitve": True}}}]},
     "job.toml: data[0].reward_args.exact_match.case_sensitve: unknown argument of reward 'exact_match'; "
     "it takes: case_sensitive, extract, score"),
    ({"data": [{"name": "a", "generator": "arithmetic", "reward": ["format"]}]},
     "job.toml: data[0].reward_args.format: reward 'format' needs the argument(s) pattern"),
    ({"algorithm": {"advantage": "grpo", "advantage_args": {"norm_stdd": False}}},
     "algorithm.advantage_args.norm_stdd: unknown argument of advantage 'grpo'; it takes: norm_std, eps"),
    ({"algorithm": {"loss_agg": "seq_mean_token_sum_norm", "loss_agg_args": {"max_length": 4}}},
     "algorithm.loss_agg_args.max_length: unknown argument of loss aggregation"),
    ({"algorithm": {"corrections": ["tis"], "correction_args": {"tis": {"uper": 2.0}}}},
     "algorithm.correction_args.tis.uper: unknown argument of correction 'tis'"),
    ({"algorithm": {"filters": ["dynamic_sampling"], "filter_args": {"dynamic_sampling": {"spread": 0.1}}}},
     "algorithm.filter_args.dynamic_sampling.spread: unknown argument of filter 'dynamic_sampling'"),
    ({"algorithm": {"kl": "k3", "kl_coef": 0.1, "kl_args": {"clip": 1.0}}},
     "algorithm.kl_args.clip: unknown argument of kl 'k3'"),
    ({"data": [{"name": "a", "generator": "arithmetic", "generator_args": {"num_sample": 3}}]},
     "data[0].generator_args.num_sample: unknown argument of data source 'arithmetic'"),
    ({"async": {"enable": True, "scheduler_args": {"batch_size": 3}}},
     "async.scheduler_args.batch_size: unknown argument of scheduler"),  # the host sets it from the job
    # values are typed by the component's annotations, with the job file's strict rules
    ({"algorithm": {"advantage": "grpo", "advantage_args": {"norm_std": "maybe"}}},
     "algorithm.advantage_args.norm_std: expected bool, got str 'maybe' (an argument of advantage 'grpo')"),
    ({"data": [{"name": "a", "generator": "arithmetic", "generator_args": {"num_samples": "3"}}]},
     "data[0].generator_args.num_samples: expected int, got str '3' (an argument of data source 'arithmetic')"),
    # factories that pass **args on: the class their spec names in args_from is the schema
    ({"data": [{"name": "a", "generator": "arithmetic", "agent_args": {"max_retries": "x"}}]},
     "data[0].agent_args.max_retries: expected int, got str 'x' (an argument of agent 'single_turn')"),
    ({"data": [{"name": "a", "generator": "arithmetic", "agent": "tool_agent", "agent_args": {"max_turn": 3}}]},
     "data[0].agent_args.max_turn: unknown argument of agent 'tool_agent'; it takes: tools, shell_tool, max_turns"),
    ({"agentflow": {"middleware": ["tool_call_parser"], "middleware_args": {"tool_call_parser": {"fmt": "x"}}}},
     "agentflow.middleware_args.tool_call_parser.fmt: unknown argument of router middleware 'tool_call_parser'"),
    ({"rollout": {"weight_transport": "shm", "weight_transport_args": {"bucket_bytes": "big"}}},
     "rollout.weight_transport_args.bucket_bytes: expected int, got str 'big' (an argument of weight transport "
     "'shm')"),
    ({"rollout": {"weight_transport": "auto", "weight_transport_args": {"shm": {"num_bufers": 2}}}},
     "rollout.weight_transport_args.shm.num_bufers: unknown argument of weight transport 'shm'"),
])
def test_bad_component_args_name_the_key(host, tables, message):
    with pytest.raises(ConfigError) as err:
        check_component_args(job(**tables), host)
    assert message in str(err.value)


def test_good_component_args_pass(host):
    check_component_args(job(algorithm={"advantage": "grpo", "advantage_args": {"norm_std": False},
                                        "corrections": ["tis"], "correction_args": {"tis": {"upper": 2.0}}},
                             data=[{"name": "a", "generator": "arithmetic", "generator_args": {"num_samples": 4},
                                    "reward": ["format"], "reward_args": {"format": {"pattern": "x"}}}]), host)


def test_a_declared_args_schema_wins_over_the_signature():
    """A spec's ``args_schema`` decides the accepted and required keys (the callable's signature
    would refuse ``strength``) and, through its validators, the values."""
    from loongsage_hookspecs import AdvantageSpec

    @attrs.define
    class Schema:
        strength: float = attrs.field(validator=attrs.validators.gt(0))
        bias: float = 0.0

    base = job(algorithm={"advantage": "scaled"})
    host = PluginHost.from_job(base)
    grpo = host.get("advantage", "grpo")
    host.register_specs(AdvantageSpec(name="scaled", fn=grpo.fn, args_schema=Schema))
    with pytest.raises(ConfigError, match=r"advantage_args: advantage 'scaled' needs the argument\(s\) strength"):
        check_component_args(job(algorithm={"advantage": "scaled", "advantage_args": {}}), host)
    with pytest.raises(ConfigError, match="algorithm.advantage_args.norm_std: unknown argument of advantage 'scaled'; "
                                          "it takes: strength, bias"):
        check_component_args(job(algorithm={"advantage": "scaled", "advantage_args": {"strength": 1.0,
                                                                                     "norm_std": False}}), host)
    with pytest.raises(ConfigError, match="algorithm.advantage_args: 'strength' must be > 0: -1"):
        check_component_args(job(algorithm={"advantage": "scaled", "advantage_args": {"strength": -1.0}}), host)
    check_component_args(job(algorithm={"advantage": "scaled", "advantage_args": {"strength": 1.0}}), host)
    with pytest.raises(TypeError, match="args_schema: expected an attrs class"):
        AdvantageSpec(name="bad", fn=grpo.fn, args_schema=dict)


@pytest.mark.parametrize("algorithm, message", [
    ({"kl_in_reward": True}, "algorithm.kl_in_reward = true but algorithm.kl is not set"),
    ({"kl": "k1", "kl_in_reward": True, "kl_coef": 0.0}, "kl_coef = 0 folds nothing"),
    ({"kl_args": {"clamp": 1.0}}, "algorithm.kl_args is set but algorithm.kl is not"),
    ({"distill_in_reward": True}, "algorithm.distill_in_reward is set but algorithm.distill_kl is not"),
    ({"distill_kl": "opd_k3"}, "no [[data]] source names a teacher"),
    ({"max_filter_retries": 2}, "algorithm.filters is empty"),
])
def test_settings_without_effect_are_refused(algorithm, message):
    with pytest.raises(ConfigError) as err:
        check_effective_settings(job(algorithm=algorithm))
    assert message in str(err.value) and str(err.value).startswith("job.toml: ")


def test_every_shipped_args_from_names_what_its_factory_builds():
    """``args_from`` is for factories that pass ``**args`` on: each shipped one imports, takes
    keyword arguments only, and its factory indeed takes ``**args``."""
    import inspect

    from loongsage_core.binding import import_target
    from loongsage_hookspecs import KINDS

    host = PluginHost.create()
    seen = 0
    for kind, record in KINDS.items():
        for name, spec in host.components(kind).items():
            if spec.args_from is None:
                continue
            seen += 1
            factory = getattr(spec, record.call().field)
            assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(factory).parameters.values())
            target = import_target(spec.args_from)
            assert all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                       for p in inspect.signature(target).parameters.values()), (kind, name)
    assert seen >= 13


def test_an_args_from_that_does_not_import_is_the_plugins_error():
    from loongsage_core.errors import PluginError
    from loongsage_hookspecs import AdvantageSpec

    host = PluginHost.from_job(job())
    grpo = host.get("advantage", "grpo")
    host.register_specs(AdvantageSpec(name="lost", fn=lambda inputs, **kw: grpo.fn(inputs, **kw),
                                      args_from="no_such_module:Thing"))
    with pytest.raises(PluginError, match="args_from 'no_such_module:Thing' does not import: ModuleNotFoundError"):
        check_component_args(job(algorithm={"advantage": "lost", "advantage_args": {"x": 1}}), host)
    with pytest.raises(TypeError, match="args_from: expected 'module:Name'"):
        AdvantageSpec(name="bad", fn=grpo.fn, args_from="no colon")
