"""How ``auto`` picks a weight transport per engine, with every shipped transport active.

The candidates are the real plugin host's (torch and sglang plugins): each transport ranks an
engine through its spec's ``auto_rank``, and the table below is every receiver kind in every
layout a run can have. An SGLang server cannot run here (no GPU), so a small HTTP server
answers ``/get_server_info`` with the fields an SGLang server reports; the embedded engine is
the real one. The shm and broadcast paths end to end: ``plugins/loongsage-plugin-torch/tests/
test_transport_broadcast.py``.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

from loongsage_core.config import JobConfig, ModelConfig, PlacementConfig
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import WeightTarget, WeightTransportContext

TOKENIZER = str(Path(__file__).resolve().parent / "data" / "tokenizer")

# what the engines report on GET /get_server_info (the fields auto reads)
EMBEDDED_CPU = {"engine": "loongsage-torch", "node_id": "node-a", "device": "cpu",
                "weight_load_formats": ["direct", "shm", "broadcast"]}
EMBEDDED_OTHER_NODE = {**EMBEDDED_CPU, "node_id": "node-b"}
EMBEDDED_GPU = {**EMBEDDED_CPU, "device": "cuda:0"}
EMBEDDED_BARE = {**EMBEDDED_CPU, "weight_load_formats": ["direct"]}  # started without the plugins
SGLANG = {"model_path": "/models/qwen3", "tp_size": 1, "device": "cuda", "version": "0.5.9",
          "host": "127.0.0.1", "port": 30000}

LAYOUTS = [
    # (engine, colocated, trainer_on_gpu, in_process, expected transport)
    ("in-process engine object", None, True, False, True, "inprocess"),
    ("embedded, this node, CPU", EMBEDDED_CPU, False, False, False, "shm"),
    ("embedded, this node, CPU, colocated actors", EMBEDDED_CPU, True, False, False, "shm"),
    ("embedded, another node", EMBEDDED_OTHER_NODE, False, False, False, "broadcast"),
    ("embedded on a GPU", EMBEDDED_GPU, False, True, False, "broadcast"),
    ("embedded without an shm receiver", EMBEDDED_BARE | {"weight_load_formats": ["broadcast"]}, False, False,
     False, "broadcast"),
    ("SGLang on the trainer's GPU (colocated)", SGLANG, True, True, False, "sglang_tensor"),
    ("SGLang on its own GPUs", SGLANG, False, True, False, "sglang_nccl"),
    ("SGLang, trainer without a GPU", SGLANG, False, False, False, "sglang_disk"),
    ("SGLang, colocated but trainer without a GPU", SGLANG, True, False, False, "sglang_disk"),
]


@pytest.fixture(scope="module")
def candidates() -> dict[str, Any]:
    host = PluginHost.create(["torch", "sglang"])
    return {name: spec for name, spec in host.components("weight_transport").items() if spec.auto_rank}


@pytest.mark.parametrize("case, info, colocated, on_gpu, in_process, expected", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_each_receiver_kind_gets_its_transport(candidates, case, info, colocated, on_gpu, in_process, expected):
    from loongsage_plugin_torch.transport.auto import choose_transport

    target = WeightTarget(url=None if in_process else "http://e:1", server_info=info or {}, trainer_node="node-a",
                          trainer_on_gpu=on_gpu, colocated=colocated, in_process=in_process)
    assert choose_transport(target, candidates) == expected


def test_the_shipped_transports_that_rank_engines(candidates):
    assert sorted(candidates) == ["broadcast", "inprocess", "sglang_disk", "sglang_nccl", "sglang_tensor", "shm"]


def test_an_engine_no_transport_reaches_is_an_error_naming_it(candidates):
    from loongsage_plugin_torch.transport.auto import choose_transport
    from loongsage_plugin_torch.transport.shm import WeightTransferError

    target = WeightTarget(url="http://e:1", server_info=EMBEDDED_BARE, trainer_node="node-a")
    with pytest.raises(WeightTransferError, match=r"no active transport reaches engine http://e:1 .*'direct'"):
        choose_transport(target, candidates)
    torch_only = {k: v for k, v in candidates.items() if not k.startswith("sglang")}
    with pytest.raises(WeightTransferError, match="enable the plugin of its transport"):
        choose_transport(WeightTarget(url="http://e:1", server_info=SGLANG, trainer_node="node-a"), torch_only)


class _InfoHandler(BaseHTTPRequestHandler):
    info: dict[str, Any] = {}

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        body = json.dumps(self.info if self.path == "/get_server_info" else {}).encode()
        self.send_response(200 if self.path == "/get_server_info" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def sglang_info_server() -> Iterator[str]:
    """An HTTP server answering ``/get_server_info`` as an SGLang server does (SGLang needs a GPU)."""
    handler = type("SGLangInfo", (_InfoHandler,), {"info": SGLANG})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("trainer_gpus, colocate, expected, sender_type", [
    (0.0, False, "sglang_disk", "DiskSender"),
    (1.0, False, "sglang_nccl", "NcclSender"),
    (1.0, True, "sglang_tensor", "TensorHandleSender"),
])
def test_a_run_routes_an_sglang_server_by_the_jobs_placement(sglang_info_server, trainer_gpus, colocate, expected,
                                                             sender_type, tmp_path):
    """The sender a run builds (registry and job from the context) asks the server over HTTP and
    builds the chosen transport's own sender with its table of ``weight_transport_args``."""
    from loongsage_plugin_torch.transport import auto_sender

    job = JobConfig(placement=PlacementConfig(trainer_gpus=trainer_gpus, engine_gpus=trainer_gpus, colocate=colocate))
    ctx = WeightTransportContext(role="sender", job=job, components=PluginHost.create(["torch", "sglang"]),
                                 where="job.toml: rollout.weight_transport")
    args = {"sglang_disk": {"directory": str(tmp_path)}} if expected == "sglang_disk" else {}
    sender = auto_sender(ctx, **args)
    try:
        assert sender.route(sglang_info_server) == expected
        assert sender.routes == {sglang_info_server: expected}
        assert type(sender._sender(expected)).__name__ == sender_type
    finally:
        sender.close()


def test_weight_transport_args_are_one_table_per_candidate_transport():
    from loongsage_plugin_torch.transport import auto_sender

    ctx = WeightTransportContext(role="sender", job=JobConfig(), components=PluginHost.create(["torch", "sglang"]))
    with pytest.raises(ValueError, match=r"unknown weight_transport_args \['bucket_bytes'\]: it takes one table per "
                                         r"transport it may choose \(broadcast, inprocess, sglang_disk, sglang_nccl, "
                                         r"sglang_tensor, shm\)"):
        auto_sender(ctx, bucket_bytes=4096)
    with pytest.raises(ValueError, match="weight_transport_args.shm must be a table"):
        auto_sender(ctx, shm=4)
    sender = auto_sender(ctx, shm={"num_buffers": 3, "nonsense": 1})
    with pytest.raises(ValueError, match="weight_transport_args.shm.nonsense: unknown argument of weight "
                                         "transport 'shm'; it takes: bucket_bytes, .*num_buffers"):
        sender._sender("shm")


def test_the_embedded_engine_over_http_gets_shm_and_the_update_lands():
    """A real embedded engine (this process, its plugins on): auto reads its server info, picks
    shared memory, and the weights it sends are the engine's afterwards."""
    from loongsage_plugin_torch.engine import create_engine
    from loongsage_plugin_torch.modeling import TINY_QWEN3
    from loongsage_plugin_torch.transport import auto_sender

    from loongsage_hookspecs import EngineContext

    host = PluginHost.create(["torch", "sglang"])
    job = JobConfig(model=ModelConfig(config=dict(TINY_QWEN3), tokenizer=TOKENIZER))
    engine = create_engine(EngineContext(job=job, components=host))
    url = engine.start()
    sender = auto_sender(WeightTransportContext(role="sender", job=job, components=host),
                         shm={"bucket_bytes": 1 << 16})
    try:
        assert sender.route(url) == "shm"
        new = {n: t + 1 for n, t in engine.runner.named_tensors().items()}
        metrics = sender.send(iter(new.items()), 3, [url])
        assert metrics["perf/weight_targets_shm"] == 1 and metrics["perf/weight_update_buckets"] > 1
        got = engine.runner.named_tensors()
        assert all(bool((got[n] == t).all()) for n, t in new.items())
        assert engine.weight_version == 3
    finally:
        sender.close()
        engine.shutdown()
