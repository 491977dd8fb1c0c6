"""An installed (non-editable) ``loongsage`` finds its own shipped configs.

The wheel is built from a copy of the host's sources with ``pip wheel --no-deps`` (no network:
the development environment's setuptools builds it), then unpacked into a directory that goes
first on ``PYTHONPATH``: the commands below import that copy, not the checkout, and run from a
directory that has no ``configs/`` of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(slow_fixture, tmp_path_factory) -> Path:
    """The ``loongsage`` wheel, built from a copy of the sources the package needs."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("loongsage_core", "configs", "examples"):  # symlinks kept, as in the checkout
        shutil.copytree(REPO / name, src / name, symlinks=True, ignore=ignore)
    out = root / "dist"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           str(src), "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("loongsage-*.whl")
    return built


def test_the_wheel_ships_every_config_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"loongsage_core/configs/{p.relative_to(REPO / 'configs').as_posix()}"
               for p in (REPO / "configs").rglob("*") if p.is_file()}
    assert shipped <= names, sorted(shipped - names)[:10]
    for must in ("quickstart/grpo.toml", "quickstart/model/model.safetensors", "recipes/grpo.toml",
                 "recipes/math_dapo/math_dapo.toml", "recipes/mopd/teacher_add/config.json",
                 "examples/my_hooks.py"):  # the example's symlink becomes a file in the wheel
        assert f"loongsage_core/configs/{must}" in names, must


def test_an_installed_package_lists_and_validates_its_recipes(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"  # no ./configs here
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "LOONGSAGE_CONFIG_PATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *args], cwd=elsewhere, env=env, capture_output=True, text=True,
                              timeout=300)

    where = run("-c", "import loongsage_core; print(loongsage_core.__file__)")
    assert Path(where.stdout.strip()).is_relative_to(site), where.stdout + where.stderr  # the unpacked copy

    listed = run("-m", "loongsage_core", "recipes", "--json")
    assert listed.returncode == 0, listed.stderr[-3000:]
    recipes = {r["name"]: r for r in json.loads(listed.stdout)["recipes"]}
    for name in ("quickstart/grpo", "recipes/grpo", "recipes/dapo", "recipes/math_dapo", "recipes/mopd",
                 "examples/custom_components"):
        assert name in recipes, sorted(recipes)
        assert Path(recipes[name]["path"]).is_relative_to(site / "loongsage_core" / "configs"), recipes[name]
    assert recipes["recipes/grpo"]["description"]

    for name in ("quickstart/grpo", "grpo", "examples/custom_components"):
        checked = run("-m", "loongsage_core", "validate", name)
        assert checked.returncode == 0, f"{name}: {checked.stderr[-3000:]}"
        assert ": OK" in checked.stdout
