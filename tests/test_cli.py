"""The ``loongsage`` CLI as a user runs it: a real subprocess per call."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loongsage_hookspecs import KINDS

pytestmark = pytest.mark.slow  # a CLI subprocess per test

REPO = Path(__file__).resolve().parent.parent
PLUGINS = sorted(p.name for p in (REPO / "plugins").iterdir() if (p / "pyproject.toml").exists())


def cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loongsage_core", *args], cwd=cwd, capture_output=True, text=True)


def test_plugins_json_lists_every_package_and_kind():
    out = cli("plugins", "--json")
    assert out.returncode == 0, out.stderr
    listing = json.loads(out.stdout)
    assert listing["hookspecs"] == list(KINDS)
    names = {p["name"] for p in listing["plugins"]}
    assert set(PLUGINS) <= names
    for p in listing["plugins"]:
        assert set(p) == {"name", "version", "components"}
        assert set(p["components"]) <= set(KINDS)


def test_plugins_human_listing():
    out = cli("plugins")
    assert out.returncode == 0
    assert "loongsage-plugin-rl 0.1.0" in out.stdout


def test_validate_accepts_the_example_job():
    out = cli("validate", "configs/examples/custom_components.toml")
    assert out.returncode == 0, out.stderr
    assert "configs/examples/custom_components.toml: OK" in out.stdout
    assert "centered_clipped" in out.stdout and "module:my_hooks" in out.stdout


def test_validate_json_resolves_components():
    out = cli("validate", "configs/examples/custom_components.toml", "train.lr=0.001", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["job"]["train"]["lr"] == 0.001
    assert data["components"]["algorithm.advantage"] == {"kind": "advantage", "name": "centered_clipped",
                                                         "plugin": "module:my_hooks"}
    assert data["components"]["data[0].reward[1]"]["plugin"] == "module:my_hooks"


BASE = """
[plugins]
modules = ["{module}"]
[model]
path = "{model}"
[algorithm]
advantage = "centered_clipped"
[[data]]
name = "a"
generator = "arithmetic"
reward = ["brevity_bonus"]
"""


@pytest.mark.parametrize("edit, key_text", [
    (lambda t: t + "\n[train]\nlearning_rate = 1.0\n", "unknown key 'train.learning_rate'"),
    (lambda t: t + "\n[train]\nlr = 'x'\n", "at key 'train.lr'"),
    (lambda t: t.replace("[plugins]", "[plugins]\nenable = [\"no-such-plugin\"]"),
     "plugin 'no-such-plugin' is not installed"),
    (lambda t: t.replace('advantage = "centered_clipped"', 'advantage = "grpoo"'),
     "algorithm.advantage: unknown advantage 'grpoo'"),
    (lambda t: t.replace("[algorithm]", "[algorithm"), "malformed TOML"),
    # component arguments are checked against the component's signature before anything runs
    (lambda t: t + "reward_args = { brevity_bonus = { target_token = 8 } }\n",
     "data[0].reward_args.brevity_bonus.target_token: unknown argument of reward 'brevity_bonus'; "
     "it takes: target_tokens, weight"),
    (lambda t: t.replace('advantage = "centered_clipped"', 'advantage = "centered_clipped"\nadvantage_args = '
                         '{ clipp = 2.0 }'), "algorithm.advantage_args.clipp: unknown argument of advantage"),
    # settings that would do nothing are refused
    (lambda t: t.replace('advantage = "centered_clipped"', 'advantage = "centered_clipped"\nkl_in_reward = true'),
     "algorithm.kl_in_reward = true but algorithm.kl is not set"),
])
def test_bad_job_files_exit_2_with_one_line(tmp_path, edit, key_text):
    text = BASE.format(module=REPO / "examples" / "my_hooks.py", model=REPO / "configs" / "quickstart" / "model")
    job = tmp_path / "bad.toml"
    job.write_text(edit(text))
    for command in ("validate", "run"):
        out = cli(command, str(job))
        assert out.returncode == 2, (command, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, out.stderr
        assert lines[0].startswith(f"loongsage: error: {job}: ") and key_text in lines[0], lines[0]


def test_unknown_component_lists_choices(tmp_path):
    text = BASE.format(module=REPO / "examples" / "my_hooks.py", model=REPO / "configs" / "quickstart" / "model")
    job = tmp_path / "job.toml"
    job.write_text(text.replace('reward = ["brevity_bonus"]', 'reward = ["brevity_bonuss"]'))
    out = cli("validate", str(job))
    assert out.returncode == 2
    assert "data[0].reward[0]: unknown reward 'brevity_bonuss' (did you mean 'brevity_bonus'?); choose one of:" \
        in out.stderr
