"""The plugin packages are listed once: the directories under ``plugins/``. Everything that must
name each of them (the requirements, tox's environments, the layer contracts) is checked against
that list, so a new plugin left out of one of them (and silently exempt from a layer rule) fails."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent
PLUGIN_DIRS = sorted(p.name for p in (REPO / "plugins").iterdir() if (p / "pyproject.toml").is_file())
PACKAGES = sorted(d.replace("-", "_") for d in PLUGIN_DIRS)
SHORT = sorted(d.removeprefix("loongsage-plugin-") for d in PLUGIN_DIRS)


def test_there_are_plugins_to_check():
    assert len(PLUGIN_DIRS) >= 9 and all(d.startswith("loongsage-plugin-") for d in PLUGIN_DIRS)


def test_requirements_install_every_plugin():
    lines = (REPO / "requirements-plugins.txt").read_text().splitlines()
    listed = sorted(re.sub(r"\[.*\]$", "", line.split("./plugins/", 1)[1]) for line in lines
                    if line.startswith("-e ./plugins/"))
    assert listed == PLUGIN_DIRS
    assert "-r requirements-plugins.txt" in (REPO / "requirements-dev.txt").read_text().splitlines()


def test_tox_has_an_environment_and_a_test_command_per_plugin():
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(REPO / "tox.ini")
    env_list = tox["tox"]["env_list"]
    factors = re.search(r"plugin-\{([^}]*)\}", env_list)
    assert factors is not None and sorted(f.strip() for f in factors.group(1).split(",")) == SHORT
    section = next(s for s in tox.sections() if s.startswith("testenv:plugin-"))
    assert sorted(s.strip() for s in section.removeprefix("testenv:plugin-{").rstrip("}").split(",")) == SHORT
    commands = tox[section]["commands"]
    for short, directory in zip(SHORT, sorted(PLUGIN_DIRS)):
        assert f"{short}: python -m pytest -q {{tox_root}}/plugins/{directory}" in commands, short
    assert "requirements-plugins.txt" in tox["testenv:lint"]["commands_pre"]


def test_every_layer_contract_names_every_plugin():
    """The import contracts of pyproject.toml: the host imports no plugin, plugins reach the host
    through its public API only, no plugin imports another; each must list every plugin package."""
    linter = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert set(PACKAGES) <= set(linter["root_packages"])
    contracts = {c["id"]: c for c in linter["contracts"]}
    assert sorted(m for m in contracts["contract"]["forbidden_modules"] if m != "loongsage_core") == PACKAGES
    assert sorted(contracts["host"]["forbidden_modules"]) == PACKAGES
    assert sorted(contracts["public-api"]["source_modules"]) == PACKAGES
    assert sorted(contracts["plugins-independent"]["modules"]) == PACKAGES

