"""Fixtures of the sglang plugin tests: stand-in SGLang control servers (see standin_sglang.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from standin_sglang import StandIn  # noqa: E402

REPO = HERE.parents[2]
TOKENIZER = REPO / "tests" / "data" / "tokenizer"


@pytest.fixture
def standin() -> Iterator[StandIn]:
    """A recording stand-in server in a thread of this process."""
    server = StandIn().start()
    yield server
    server.stop()


@pytest.fixture
def standin_process(slow_fixture, tmp_path: Path) -> Iterator[str]:
    """A stand-in server in a subprocess that joins weight groups (gloo); yields its URL."""
    port_file = tmp_path / "url"
    proc = subprocess.Popen([sys.executable, str(HERE / "standin_sglang.py"), str(port_file)],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "standin.log", "wb"))
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("stand-in server did not start: " + (tmp_path / "standin.log").read_text())
            time.sleep(0.05)
        yield port_file.read_text()
    finally:
        proc.kill()
        proc.wait(timeout=30)


EMBEDDED_ENGINE = """
import sys, threading
from pathlib import Path
from loongsage_plugin_torch.engine import create_engine
from loongsage_plugin_torch.modeling import TINY_QWEN3
from loongsage_core.config import JobConfig, ModelConfig
from loongsage_hookspecs import EngineContext

job = JobConfig(model=ModelConfig(config=dict(TINY_QWEN3), tokenizer=sys.argv[2], seed=1))
url = create_engine(EngineContext(job=job, components=None)).start()
Path(sys.argv[1]).write_text(url)
threading.Event().wait()
"""


@pytest.fixture
def embedded_engine_process(slow_fixture, tmp_path: Path) -> Iterator[str]:
    """The torch plugin's embedded engine (tiny Qwen3, seed-1 weights) in a subprocess; yields its URL."""
    url_file = tmp_path / "engine_url"
    log = tmp_path / "engine.log"
    proc = subprocess.Popen([sys.executable, "-c", EMBEDDED_ENGINE, str(url_file), str(TOKENIZER)],
                            stdout=subprocess.DEVNULL, stderr=open(log, "wb"),
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not url_file.exists() or not url_file.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("embedded engine did not start: " + log.read_text())
            time.sleep(0.05)
        yield url_file.read_text()
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.fixture
def trainer_model():
    """The same tiny Qwen3 with other (seed-0) weights: what a trainer would send."""
    from loongsage_plugin_torch.modeling import TINY_QWEN3, load_model

    from loongsage_core.config import JobConfig, ModelConfig

    return load_model(JobConfig(model=ModelConfig(config=dict(TINY_QWEN3), tokenizer=str(TOKENIZER))), seed=0)
