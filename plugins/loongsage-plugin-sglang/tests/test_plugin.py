"""Registration of the sglang plugin: names, descriptions, receivers, and a light plugin module."""

from __future__ import annotations

import subprocess
import sys

from loongsage_plugin_sglang import plugin
from loongsage_plugin_sglang.server import SGLangServer

from loongsage_hookspecs import EngineContext, RolloutEngineSpec, WeightTransportContext, WeightTransportSpec


def test_components_and_descriptions():
    engines = {s.name: s for s in plugin.loongsage_rollout_engines()}
    transports = {s.name: s for s in plugin.loongsage_weight_transports()}
    assert set(engines) == {"sglang"} and set(transports) == {"sglang_disk", "sglang_nccl", "sglang_tensor"}
    assert [r.name for r in plugin.loongsage_engine_routers()] == ["sglang_router"]
    assert isinstance(engines["sglang"], RolloutEngineSpec)
    for spec in [*engines.values(), *transports.values()]:
        assert spec.description and len(spec.description) < 160
    for spec in transports.values():
        assert isinstance(spec, WeightTransportSpec)
        assert spec.receiver is None  # the engines' own endpoints receive them
    sender = WeightTransportContext(role="sender")
    assert type(transports["sglang_disk"].sender(sender)).__name__ == "DiskSender"
    assert type(transports["sglang_nccl"].sender(sender, backend="gloo")).__name__ == "NcclSender"


def test_engine_factory_builds_a_server_without_launching(tmp_path):
    from loongsage_core.config import structure_job

    (tmp_path / "m").mkdir()
    job = structure_job({"model": {"path": "m"}, "rollout": {"engine": "sglang"}}, str(tmp_path / "job.toml"))
    spec = next(iter(plugin.loongsage_rollout_engines()))
    server = spec.factory(EngineContext(job=job, components=None, engine_index=0, port=31999))
    assert isinstance(server, SGLangServer) and server.process is None
    assert server.command[server.command.index("--port") + 1] == "31999"


def test_plugin_module_imports_light():
    code = ("import sys, time; t = time.perf_counter(); import loongsage_plugin_sglang.plugin; "
            "dt = time.perf_counter() - t; heavy = [m for m in ('torch', 'httpx', 'sglang', 'sglang_router', "
            "'safetensors', 'subprocess') if m in sys.modules]; print(heavy, dt)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "[]", out
