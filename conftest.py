"""Settings every test directory shares (this file sits at the repository root, above them all).

Property tests run with no per-example deadline: on a loaded machine (CI, a flake hunt under CPU
load) one example may take longer than Hypothesis's 200 ms default without anything being wrong.
Under the flake hunt's random order (``-p randomly``, a seed per run printed in the header)
Hypothesis's own randomness follows that seed, so a failing run replays with
``-p randomly --randomly-seed=SEED``.

The fast lane: ``pytest -m "not slow"`` leaves out every test marked ``slow``. A test is marked at
collection (:func:`pytest_collection_modifyitems`) when any fixture it uses, directly or through
other fixtures, requests :func:`slow_fixture`: the fixtures that start a Ray cluster, run the CLI,
the controller or a script in a subprocess, spawn trainer ranks, run programs in a sandbox, drive a
browser or start an agent CLI request it. A test that starts such a process itself, without a
fixture, carries ``@pytest.mark.slow`` (or its module a ``pytestmark``) by hand.
"""

from __future__ import annotations

import pytest

try:
    from hypothesis import settings
except ImportError:  # an environment without property tests (tox's hookspecs env) has nothing to set
    settings = None

if settings is not None:
    settings.register_profile("loongsage", deadline=None)
    settings.load_profile("loongsage")


@pytest.fixture(autouse=True)
def no_run_secret_from_an_earlier_test():
    """Each test starts without a run secret in this process: a controller run (``run_job``) sets
    one process-wide until it closes, and a test that stops a run half-way (or builds a controller
    without closing it) would otherwise leave it to a later test."""
    try:
        from loongsage_core.security import set_process_secret
    except ImportError:  # an environment without the host (tox's hookspecs env)
        yield
        return
    set_process_secret(None)
    yield
    set_process_secret(None)


@pytest.fixture(scope="session")
def slow_fixture() -> None:
    """Requested by a fixture that starts something expensive (a Ray cluster, a subprocess running
    the CLI, the controller or a script, spawned trainer ranks, programs in a sandbox, a browser, an
    agent CLI): every test whose fixture closure contains it is marked ``slow``, so the fast lane
    (``pytest -m "not slow"``) leaves it out. Provides nothing."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``slow`` every test that uses, directly or through other fixtures, :func:`slow_fixture`."""
    for item in items:
        if "slow_fixture" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
