"""Shared fixtures: fake installed plugin distributions (real dist-info on sys.path), the local Ray
cluster, the tiny job, and one-off engine-client calls from a test (`engine_call`)."""

from __future__ import annotations

import asyncio
import importlib
import sys
import textwrap
from pathlib import Path
from typing import Any, Awaitable, Callable, TypeVar

import pytest

T = TypeVar("T")

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
def ray_cluster(slow_fixture):
    """One local Ray cluster for the whole test session: loopback, small object store, no dashboard."""
    import ray

    from loongsage_core.controller.placement import start_local_cluster

    if not ray.is_initialized():
        start_local_cluster(num_cpus=4, object_store_mb=128)
    yield ray
    ray.shutdown()


TINY_JOB = """
[plugins]
enable = ["torch", "rl", "rewards", "loggers", "agents"]
[model]
tokenizer = "{tokenizer}"
[model.config]
model_type = "qwen3"
vocab_size = 512
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 2
num_key_value_heads = 1
head_dim = 16
max_position_embeddings = 512
tie_word_embeddings = true
[train]
lr = 1e-3
total_steps = 3
mini_batch_size = 8
micro_batch_size = 4
[rollout]
prompts_per_step = 2
samples_per_prompt = 4
max_new_tokens = 6
max_context_length = 256
[run]
seed = 7
checkpoint_every = 1
keep_checkpoints = 5
save_hf_at_end = false
[[data]]
name = "add"
generator = "arithmetic"
generator_args = {{ num_samples = 16 }}
reward = ["exact_match"]
[[loggers]]
name = "jsonl"
"""
"""A tiny embedded job (random 2-layer Qwen3, 2 prompts x 4 samples, a checkpoint every step)."""


class TinyJob:
    """Writes :data:`TINY_JOB` into a directory and runs it in this process."""

    @staticmethod
    def write(job_dir: Path, name: str = "job.toml") -> Path:
        path = job_dir / name
        path.write_text(TINY_JOB.format(tokenizer=TOKENIZER_DIR))
        return path

    def run(self, job_dir: Path, out: Path, *overrides: str, overwrite: bool = False) -> list[dict]:
        from loongsage_core.config import load_job
        from loongsage_core.controller.run import run_job
        from loongsage_core.resolve import resolve_job

        job = load_job(self.write(job_dir), list(overrides))
        return run_job(resolve_job(job), output_dir=str(out), overwrite=overwrite)


@pytest.fixture
def tiny_job(slow_fixture) -> TinyJob:
    """The tiny embedded job of :data:`TINY_JOB` (use with ``ray_cluster``)."""
    return TinyJob()


def call_engine(url: str, call: Callable[[Any], Awaitable[T]], api_key: str | None = None) -> T:
    """``call`` (an async engine-client call, e.g. ``lambda c: c.weight_version()``) run to its end
    from the test's thread, on a client of ``url`` (with ``api_key``) closed afterwards."""
    from loongsage_core.engine_client import EngineClient

    async def run() -> T:
        client = EngineClient(url, api_key=api_key)
        try:
            return await call(client)
        finally:
            await client.aclose()

    return asyncio.run(run())


@pytest.fixture
def engine_call() -> Callable[..., Any]:
    """:func:`call_engine`: one engine-client call from a test, on a client of its own."""
    return call_engine
