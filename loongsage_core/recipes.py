"""Job files by name: ``loongsage run grpo`` as well as ``loongsage run path/to/job.toml``.

A *recipe* is any ``*.toml`` job file under a config directory; its name is its path there without
``.toml`` (``recipes/grpo``, ``quickstart/grpo``); a file named like its folder is also named by the
folder (``recipes/math_dapo/math_dapo.toml`` is ``recipes/math_dapo``). The ``recipes/`` prefix may
be left out (``grpo`` is ``recipes/grpo``). Config directories, searched in this order:

1. every directory in ``LOONGSAGE_CONFIG_PATH`` (``os.pathsep``-separated),
2. ``./configs`` of the working directory,
3. the configs shipped with LoongSage: ``loongsage_core/configs`` (package data of an installed
   ``loongsage``; in a checkout a symlink to the repository's ``configs/``).

A recipe's description is the first sentence of the comment block at the top of its file.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

import attrs

from .config import ConfigError

CONFIG_PATH_ENV = "LOONGSAGE_CONFIG_PATH"
DEFAULT_PREFIX = "recipes/"
SHIPPED_CONFIGS = Path(__file__).resolve().parent / "configs"
"""The configs shipped with the package (a symlink to the repository's ``configs/`` in a checkout)."""


@attrs.frozen
class Recipe:
    """One named job file."""

    name: str
    description: str
    path: Path

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "description": self.description, "path": str(self.path)}


def config_dirs() -> list[Path]:
    """The directories searched for named job files, first match wins (see the module docstring)."""
    dirs = [Path(p) for p in os.environ.get(CONFIG_PATH_ENV, "").split(os.pathsep) if p]
    dirs += [Path.cwd() / "configs", SHIPPED_CONFIGS]
    seen: list[Path] = []
    for d in dirs:
        if d.is_dir() and d.resolve() not in seen:
            seen.append(d.resolve())
    return seen


def describe(path: Path) -> str:
    """The first sentence of the comment block that opens a job file ('' when there is none)."""
    lines: list[str] = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.startswith("#"):
            break
        text = line[1:].strip()
        if not text or line.startswith("#  "):  # a blank comment line or an indented usage example
            break
        lines.append(text)
    block = " ".join(lines)
    # a sentence ends at ". " after a word of three or more characters ("Dr. GRPO" goes on)
    match = re.match(r"(.+?\w{3,}[.!?])(\s|$)", block)
    return match.group(1) if match else block


def _names(root: Path, path: Path) -> list[str]:
    rel = path.relative_to(root).with_suffix("")
    names = [rel.as_posix()]
    if rel.parent.name == rel.name:  # recipes/math_dapo/math_dapo.toml is also recipes/math_dapo
        names.insert(0, rel.parent.as_posix())
    return names


def list_recipes() -> list[Recipe]:
    """Every named job file in the config directories, the first directory's winning a name clash."""
    found: dict[str, Recipe] = {}
    for root in config_dirs():
        for path in sorted(root.rglob("*.toml")):
            name = _names(root, path)[0]
            if name not in found:
                found[name] = Recipe(name=name, description=describe(path), path=path)
    return sorted(found.values(), key=lambda r: r.name)


def find_job(spec: str | os.PathLike[str]) -> Path:
    """The job file a command line names: an existing path, else a recipe name.

    Raises:
        ConfigError: neither a file nor a known name, with the closest names as a hint.
    """
    path = Path(spec)
    if path.is_file():
        return path
    text = str(spec)
    if path.suffix == ".toml" or path.is_absolute() or text.startswith((".", "~")):
        raise ConfigError(f"{text}: job file not found")
    name = text.removesuffix(".toml")
    by_name: dict[str, Path] = {}
    for root in config_dirs():
        for candidate in sorted(root.rglob("*.toml")):
            for n in _names(root, candidate):
                by_name.setdefault(n, candidate)
    for key in (name, DEFAULT_PREFIX + name):
        if key in by_name:
            return by_name[key]
    hint = difflib.get_close_matches(name, list(by_name), n=3, cutoff=0.5)
    hint += [n for n in difflib.get_close_matches(DEFAULT_PREFIX + name, list(by_name), n=3, cutoff=0.5)
             if n not in hint]
    did_you_mean = f"; did you mean {', '.join(repr(h) for h in hint[:3])}?" if hint else ""
    raise ConfigError(f"{text}: no job file or recipe of that name (`loongsage recipes` lists them){did_you_mean}")
