import subprocess
import sys
from importlib.metadata import entry_points

from loongsage_plugin_rewards import plugin

from loongsage_hookspecs import DataSourceSpec, RewardSpec


def test_hooks_provide_the_documented_components():
    rewards = {s.name: s for s in plugin.loongsage_rewards()}
    sources = {s.name: s for s in plugin.loongsage_data_sources()}
    assert set(rewards) == {"exact_match", "token_f1", "numeric_match", "format", "math_verify", "countdown",
                            "reasoning_gym", "swe_tests", "code_tests"}
    assert {n for n, s in rewards.items() if s.needs_sandbox} == {"swe_tests", "code_tests"}
    assert set(sources) == {"arithmetic", "countdown", "reasoning_gym"}
    assert all(isinstance(s, RewardSpec) and s.description for s in rewards.values())
    assert all(isinstance(s, DataSourceSpec) and s.description for s in sources.values())


def test_every_data_source_row_is_scored_by_its_reward():
    rewards = {s.name: s.fn for s in plugin.loongsage_rewards()}
    sources = {s.name: s.factory for s in plugin.loongsage_data_sources()}
    from loongsage_hookspecs import Trajectory

    cases = [("arithmetic", {}, "exact_match", lambda r: r["label"]),
             ("countdown", {}, "countdown", lambda r: r["metadata"]["solution"]),
             ("reasoning_gym", {"dataset": "chain_sum"}, "reasoning_gym", lambda r: r["label"])]
    for source, args, reward, answer in cases:
        rows = list(sources[source](num_samples=3, seed=1, **args))
        for row in rows:
            t = Trajectory(id="t", prompt_id="p", group_id="g", prompt=row["prompt"], label=row["label"],
                           metadata=row["metadata"], response_text=str(answer(row)))
            assert rewards[reward](t).score == 1.0, (source, row)


def test_entry_point_is_registered():
    eps = {ep.name: ep.value for ep in entry_points(group="loongsage")}
    assert eps.get("rewards") == "loongsage_plugin_rewards.plugin"


def test_plugin_module_import_is_light():
    code = ("import sys, loongsage_plugin_rewards.plugin; "
            "print(sorted(m for m in ('torch', 'sympy', 'math_verify', 'reasoning_gym', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
