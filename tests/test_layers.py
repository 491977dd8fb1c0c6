"""The layer rules of the root ``pyproject.toml`` (``[tool.importlinter]``), checked by the real
``lint-imports``: the tree keeps them, and a planted violation is reported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tomli_w

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
LINT = [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"]


def lint_imports(*args: str, cwd: Path = REPO, pythonpath: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    return subprocess.run([*LINT, "--no-cache", "--no-logo", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_tree_keeps_every_layer_rule():
    out = lint_imports()
    assert out.returncode == 0, out.stdout + out.stderr
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert f"Contracts: {len(config['contracts'])} kept, 0 broken." in out.stdout
    # every installable package of the repository is under the rules
    packages = {p.parent.name for p in (REPO / "plugins").glob("loongsage-plugin-*/loongsage_plugin_*/__init__.py")}
    assert packages <= set(config["root_packages"])


def test_a_plugin_that_imports_a_private_host_module_or_another_plugin_is_reported(tmp_path):
    planted = tmp_path / "loongsage_plugin_planted"
    planted.mkdir()
    (planted / "__init__.py").write_text('"""A plugin that breaks the rules."""\n')
    (planted / "private.py").write_text("from loongsage_core.config import JobConfig  # a private host module\n")
    (planted / "sibling.py").write_text("def lazy():\n    import loongsage_plugin_rl  # another plugin\n")
    (planted / "fine.py").write_text("from loongsage_core.backend_api import structure_args\n")
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    rules = config["tool"]["importlinter"]
    rules["root_packages"].append(planted.name)
    for contract in rules["contracts"]:
        for key in ("source_modules", "forbidden_modules", "modules"):
            if "loongsage_plugin_rl" in contract.get(key, ()):
                contract[key].append(planted.name)
    path = tmp_path / "layers.toml"
    path.write_text(tomli_w.dumps({"tool": {"importlinter": rules}}))

    out = lint_imports("--config", str(path), cwd=tmp_path, pythonpath=str(tmp_path))
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout
    assert "Plugins import the host only through loongsage_core.backend_api BROKEN" in text
    assert "loongsage_plugin_planted.private -> loongsage_core.config" in text
    assert "No plugin imports another plugin BROKEN" in text
    assert "loongsage_plugin_planted.sibling -> loongsage_plugin_rl" in text
    assert "loongsage_plugin_planted.fine" not in text  # the public API is allowed
    assert "The host (loongsage_core) imports no plugin KEPT" in text


def test_an_upward_import_inside_the_host_is_reported(tmp_path):
    """The host's layer contract fires: in a copy of ``loongsage_core`` whose job schema imports the
    controller (a lower layer reaching up), ``lint-imports`` reports exactly that chain."""
    import shutil

    copy = tmp_path / "loongsage_core"
    shutil.copytree(REPO / "loongsage_core", copy, ignore=shutil.ignore_patterns("__pycache__", "configs"))
    (copy / "config" / "planted.py").write_text("def lazy():\n    from ..controller import run  # upward\n")
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    rules = config["tool"]["importlinter"]
    rules["contracts"] = [c for c in rules["contracts"] if c["id"] == "host-layers"]
    rules["root_packages"] = ["loongsage_core"]
    path = tmp_path / "layers.toml"
    path.write_text(tomli_w.dumps({"tool": {"importlinter": rules}}))

    out = lint_imports("--config", str(path), cwd=tmp_path, pythonpath=str(tmp_path))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "The host's own layers" in out.stdout and "BROKEN" in out.stdout
    assert "loongsage_core.config.planted -> loongsage_core.controller.run" in out.stdout
