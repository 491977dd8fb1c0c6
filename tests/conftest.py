"""Shared fixtures: fake installed plugin distributions (real dist-info on sys.path)."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO / "tests" / "data" / "tokenizer"


def _write_dist(root: Path, dist: str, entry_name: str, module: str, code: str) -> None:
    (root / f"{module}.py").write_text(textwrap.dedent(code))
    info = root / f"{dist.replace('-', '_')}-0.3.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3.1\n")
    (info / "entry_points.txt").write_text(f"[loongsage]\n{entry_name} = {module}\n")


@pytest.fixture
def install_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str, str, str], None]:
    """Install a plugin distribution for this test: a module plus a dist-info with an entry point."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    added: list[str] = []

    def install(dist: str, entry_name: str, module: str, code: str) -> None:
        _write_dist(site, dist, entry_name, module, code)
        added.append(module)
        importlib.invalidate_caches()

    yield install
    for m in added:
        sys.modules.pop(m, None)
    importlib.invalidate_caches()


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole test session: loopback, small object store, no dashboard."""
    import ray

    from loongsage_core.controller.placement import bind_ray_to_loopback

    if not ray.is_initialized():
        bind_ray_to_loopback()
        ray.init(num_cpus=4, object_store_memory=128 * 2**20, include_dashboard=False,
                 _node_ip_address="127.0.0.1", log_to_driver=False,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()
