"""Servers of a run listen beyond loopback only with the run secret (``security.check_listen_address``):
the embedded engine refuses to start there without it, before binding anything."""

from __future__ import annotations

import pytest

from loongsage_core.security import check_listen_address, is_loopback


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.3.2.1", True), ("localhost", True), ("::1", True), ("[::1]", True),
    ("0.0.0.0", False), ("192.0.2.7", False), ("10.1.2.3", False), ("::", False), ("node-7.cluster", False),
])
def test_loopback_addresses(host, loopback):
    assert is_loopback(host) is loopback


def test_beyond_loopback_needs_the_secret():
    check_listen_address("127.0.0.1", None, "engine")  # loopback: allowed without a secret
    check_listen_address("192.0.2.7", "s3cret", "engine")  # with the secret: allowed anywhere
    with pytest.raises(ValueError, match="^engine: refusing to listen on 192.0.2.7 \\(beyond loopback\\) "
                                         "without the run secret"):
        check_listen_address("192.0.2.7", None, "engine")
    with pytest.raises(ValueError, match="refusing to listen on 0.0.0.0"):
        check_listen_address("0.0.0.0", "", "engine")


def test_embedded_engine_refuses_every_interface_without_the_secret():
    from loongsage_plugin_torch.engine import create_engine
    from loongsage_plugin_torch.modeling import TINY_QWEN3

    from loongsage_core.config import JobConfig, ModelConfig
    from loongsage_hookspecs import EngineContext

    job = JobConfig(model=ModelConfig(config=dict(TINY_QWEN3)))
    engine = create_engine(EngineContext(job=job, components=None, host="0.0.0.0"))
    try:
        with pytest.raises(ValueError, match="embedded engine: refusing to listen on 0.0.0.0"):
            engine.start()
        assert engine.base_url is None and not engine.scheduler.alive  # refused before starting anything
    finally:
        engine.shutdown()
