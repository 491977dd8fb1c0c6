"""The plugin module: every component is provided through the hooks, named uniquely, described,
documented in the README, and listing them does not import torch."""

from __future__ import annotations

import inspect
import pathlib
import subprocess
import sys

import pluggy
import pytest
from loongsage_plugin_rl import plugin

from loongsage_hookspecs import KINDS, PROJECT_NAME, hookspecs

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"

EXPECTED = {
    "advantage": {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"},
    "policy_loss": {"ppo_clip", "gspo", "cispo", "reinforce"},
    "kl": {"k1", "k2", "k3", "low_var_kl"},
    "loss_aggregation": {"token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"},
    "correction": {"tis", "m2po", "opsm"},
    "filter": {"dynamic_sampling", "overlong", "status"},
    "reward": {"overlong_penalty"},
}


def provided() -> dict[str, list]:
    """Specs per kind, collected the way a host does: a pluggy manager with the contract's hookspecs."""
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(plugin)
    pm.check_pending()  # every hookimpl in plugin.py names a real hook
    out = {}
    for kind in KINDS.values():
        specs = [s for batch in getattr(pm.hook, kind.hook)() for s in batch]
        if specs:
            out[kind.name] = specs
    return out


def test_every_component_is_provided_once_with_a_description():
    specs = provided()
    assert {k: {s.name for s in v} for k, v in specs.items()} == EXPECTED
    for kind, items in specs.items():
        names = [s.name for s in items]
        assert len(names) == len(set(names)), f"duplicate {kind} names: {names}"
        for s in items:
            assert isinstance(s, KINDS[kind].spec)
            assert s.description.strip(), f"{kind} {s.name} has no description"
            assert callable(s.fn)


def test_spec_flags():
    specs = {k: {s.name: s for s in v} for k, v in provided().items()}
    assert specs["advantage"]["gae"].needs_critic
    assert not any(s.needs_critic for n, s in specs["advantage"].items() if n != "gae")
    assert specs["correction"]["opsm"].stage == "post_forward"
    assert specs["correction"]["tis"].stage == specs["correction"]["m2po"].stage == "pre_advantage"
    assert all(s.requires == "logprobs" for s in specs["kl"].values())


def test_readme_documents_every_component_and_argument():
    text = README.read_text()
    for kind, items in provided().items():
        for s in items:
            assert f"`{s.name}`" in text, f"README lacks {kind} {s.name}"
            for p in inspect.signature(s.fn).parameters.values():
                if p.kind is inspect.Parameter.KEYWORD_ONLY:
                    assert f"`{p.name}`" in text, f"README lacks argument {p.name} of {s.name}"


def test_listing_components_does_not_import_torch():
    code = (
        "import sys\n"
        "import loongsage_plugin_rl, loongsage_plugin_rl.plugin as p\n"
        "n = sum(len(list(getattr(p, h)())) for h in dir(p) if h.startswith('loongsage_'))\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print(n)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == sum(len(v) for v in EXPECTED.values())


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_components_reject_unknown_arguments(kind):
    """Arguments come from job-file tables; a typo must fail, not be ignored."""
    for s in provided()[kind]:
        params = inspect.signature(s.fn).parameters.values()
        assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params), s.name
