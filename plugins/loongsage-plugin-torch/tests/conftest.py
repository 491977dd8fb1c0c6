"""Shared set-up of the torch plugin's tests.

The tests run with ``--import-mode=importlib``, so a test module cannot import another one; the
helpers several of them share live in ``torch_test_support.py`` beside them, and this folder is
put on ``sys.path`` (conftest files load before the test modules are collected) so that they can
``import torch_test_support``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(scope="module")
def ray_local(slow_fixture):
    """The session's Ray cluster when one is up, else a small local one for the module."""
    import ray

    from loongsage_core.controller.placement import start_local_cluster

    started = not ray.is_initialized()
    if started:
        start_local_cluster(num_cpus=4, object_store_mb=128)
    yield ray
    if started:
        ray.shutdown()
