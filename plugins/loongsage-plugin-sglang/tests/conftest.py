"""Fixtures of the sglang plugin tests: stand-in SGLang control servers (see standin_sglang.py)."""

from __future__ import annotations

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
def standin_process(tmp_path: Path) -> Iterator[str]:
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
