"""The ``broadcast`` weight transport between Ray actors over a Gloo group.

Two set-ups, both on a real local Ray cluster:

* a sender actor and two receiver actors, each around a real ``BroadcastReceiver``, reached by a
  callable target (one Ray call per request): bucket boundaries, every dtype, a tensor split
  across buckets, non-contiguous and empty tensors, all received bit-exact, the group set up
  once and reused;
* a trainer actor (torch backend) sending to an embedded engine served by another actor over
  HTTP: the engine's weights become bit-equal to the trainer's and carry the new version.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest
import torch

from loongsage_hookspecs import WeightTransportContext

SENDER = WeightTransportContext(role="sender")


def auto_context() -> WeightTransportContext:
    """A sender context with the plugin registry ``auto`` chooses its transports from."""
    from loongsage_core.plugins import PluginHost

    return WeightTransportContext(role="sender", components=PluginHost.create(["torch"]))
RECEIVER = WeightTransportContext(role="receiver")

TOKENIZER = str(Path(__file__).resolve().parents[3] / "tests" / "data" / "tokenizer")


def digest(t: torch.Tensor) -> list:
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return [hashlib.sha256(raw).hexdigest(), str(t.dtype).removeprefix("torch."), list(t.shape)]


class Recorder:
    """An engine-shaped endpoint around a real BroadcastReceiver that records what arrives."""

    def __init__(self) -> None:
        from loongsage_plugin_torch.transport import broadcast_receiver

        self.receiver = broadcast_receiver(RECEIVER)
        self.digests: dict[str, list] = {}
        self.versions: list[str] = []
        self.requests = 0

    def handle(self, path: str, body: dict) -> dict:
        if path == "/init_weights_update_group":
            self.receiver.join(body["master_address"], body["master_port"], body["rank_offset"], body["world_size"],
                               group_name=body["group_name"], backend=body["backend"], timeout_s=60)
        elif path == "/update_weights_from_distributed":
            self.requests += 1
            for name, tensor in self.receiver.receive(body):
                self.digests[name] = digest(tensor)
            if body.get("weight_version") is not None:
                self.versions.append(body["weight_version"])
        elif path == "/destroy_weights_update_group":
            return {"success": self.receiver.leave(body["group_name"])}
        return {"success": True}

    def state(self) -> dict:
        return {"digests": self.digests, "versions": self.versions, "requests": self.requests,
                "groups": self.receiver.groups}


class Sender:
    """The trainer side: a BroadcastSender whose targets are the recorder actors."""

    def __init__(self, recorders: list, bucket_bytes: int) -> None:
        import ray
        from loongsage_plugin_torch.transport import broadcast_sender

        self.sender = broadcast_sender(SENDER, bucket_bytes=bucket_bytes, backend="gloo", init_timeout_s=60)
        self.targets = [lambda path, body, r=r: ray.get(r.handle.remote(path, body)) for r in recorders]

    def send(self, tensors: list, version: int) -> dict:
        return self.sender.send(tensors, version, self.targets)

    def close(self) -> None:
        self.sender.close()


def weights(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [("embed", torch.randn(300, 64, generator=g)),                    # 76800 B: split over buckets
            ("norm", torch.randn(64, generator=g).to(torch.bfloat16)),
            ("proj", torch.randn(64, 32, generator=g).to(torch.float16).t()),  # non-contiguous
            ("ids", torch.arange(1000, dtype=torch.int64) * seed),
            ("mask", torch.rand(77, generator=g) > 0.5),
            ("scale", torch.tensor(0.5 * seed)),
            ("empty", torch.zeros(0, 8)),
            ("tail", torch.randn(16381, generator=g).double())]             # 131048 B: several buckets


def test_broadcast_between_ray_actors_is_bit_exact(ray_local):
    ray = ray_local
    recorders = [ray.remote(Recorder).remote() for _ in range(2)]
    sender = ray.remote(Sender).remote(recorders, 16384)
    try:
        first_metrics = None
        for version, seed in ((1, 1), (2, 2)):
            tensors = weights(seed)
            metrics = ray.get(sender.send.remote(tensors, version))
            first_metrics = first_metrics or metrics
            expected_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
            assert metrics["perf/weight_update_bytes"] == expected_bytes
            # 16 KiB buckets: at least ceil(bytes / 16 KiB) of them, each one broadcast
            assert metrics["perf/weight_update_buckets"] >= -(-expected_bytes // 16384)
            for state in ray.get([r.state.remote() for r in recorders]):
                assert state["digests"] == {n: digest(t) for n, t in tensors}
                assert state["versions"] == [str(v) for v in range(1, version + 1)]
                assert state["groups"] == ["loongsage_weights"]
        assert first_metrics["timing/weight_group_setup_s"] > 0
        assert metrics["timing/weight_group_setup_s"] == 0  # the group is set up once and reused
        ray.get(sender.close.remote())
        assert [s["groups"] for s in ray.get([r.state.remote() for r in recorders])] == [[], []]
    finally:
        for actor in (*recorders, sender):
            ray.kill(actor)


class EngineHost:
    """An embedded engine served from this actor (seed 1 weights) plus a view of its tensors;
    ``plugins``: give it the installed plugins' weight transports (as model actors do)."""

    def __init__(self, job, plugins: bool = False) -> None:
        from loongsage_plugin_torch.engine import create_engine

        from loongsage_core.plugins import PluginHost
        from loongsage_hookspecs import EngineContext

        components = PluginHost.from_job(job) if plugins else None
        self.engine = create_engine(EngineContext(job=job, components=components))
        self.url = self.engine.start()

    def base_url(self) -> str:
        return self.url

    def digests(self) -> dict:
        return {n: digest(t) for n, t in self.engine.runner.named_tensors().items()}

    def shutdown(self) -> None:
        self.engine.shutdown()


class TrainerHost:
    """A torch-backend trainer rank (seed 0 weights) with a broadcast sender."""

    def __init__(self, job, transport: str = "broadcast") -> None:
        from loongsage_plugin_torch.trainer import create_train_worker
        from loongsage_plugin_torch.transport import auto_sender, broadcast_sender

        from loongsage_hookspecs import TrainWorkerContext

        self.worker = create_train_worker(TrainWorkerContext(job=job, components=None, role="reference"))
        args = {"bucket_bytes": 4096, "backend": "auto", "init_timeout_s": 60}
        self.sender = (broadcast_sender(SENDER, **args) if transport == "broadcast"
                       else auto_sender(auto_context(), broadcast=args, shm={"bucket_bytes": 4096}))

    def digests(self) -> dict:
        return {n: digest(t) for n, t in self.worker.named_weights()}

    def push(self, urls: str | list[str], version: int) -> dict:
        return self.sender.send(self.worker.named_weights(), version, [urls] if isinstance(urls, str) else urls)

    def close(self) -> None:
        self.sender.close()


def test_trainer_actor_broadcasts_into_embedded_engine_actor(ray_local):
    from loongsage_plugin_torch.modeling import TINY_QWEN3

    from loongsage_core.config import JobConfig, ModelConfig

    ray = ray_local
    engine_job = JobConfig(model=ModelConfig(config=dict(TINY_QWEN3), tokenizer=TOKENIZER, seed=1))
    trainer_job = JobConfig(model=ModelConfig(config=dict(TINY_QWEN3), tokenizer=TOKENIZER, seed=0))
    engine = ray.remote(EngineHost).remote(engine_job)
    trainer = ray.remote(TrainerHost).remote(trainer_job)
    try:
        url = ray.get(engine.base_url.remote())
        want = ray.get(trainer.digests.remote())
        before = ray.get(engine.digests.remote())
        assert any(before[n] != d for n, d in want.items())
        metrics = ray.get(trainer.push.remote(url, 5))
        assert metrics["perf/weight_update_buckets"] > 1
        after = ray.get(engine.digests.remote())
        assert {n: after[n] for n in want} == want
        assert httpx.get(url + "/get_weight_version", trust_env=False).json()["weight_version"] == "5"
        # the engine still serves, with the new version on every token
        out = httpx.post(url + "/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}},
                         trust_env=False, timeout=60).json()
        assert out["meta_info"]["output_token_weight_versions"] == [5] * len(out["output_ids"])
        ray.get(trainer.push.remote(url, 6))  # the same group again
        assert httpx.get(url + "/get_weight_version", trust_env=False).json()["weight_version"] == "6"
        ray.get(trainer.close.remote())
    finally:
        ray.get(engine.shutdown.remote())
        for actor in (engine, trainer):
            ray.kill(actor)


def test_auto_picks_shm_on_this_node_and_broadcast_across_nodes(ray_local):
    from loongsage_plugin_torch.modeling import TINY_QWEN3

    from loongsage_core.config import JobConfig, ModelConfig

    ray = ray_local
    engine_job = JobConfig(model=ModelConfig(config=dict(TINY_QWEN3), tokenizer=TOKENIZER, seed=1))
    trainer_job = JobConfig(model=ModelConfig(config=dict(TINY_QWEN3), tokenizer=TOKENIZER, seed=0))
    local = ray.remote(EngineHost).remote(engine_job, plugins=True)
    # another node id: the engine cannot map this node's shared memory, as on another machine
    remote = ray.remote(EngineHost).options(runtime_env={"env_vars": {"LOONGSAGE_NODE_ID": "node-b"}}).remote(
        engine_job, plugins=True)
    trainer = ray.remote(TrainerHost).remote(trainer_job, "auto")
    engines = (local, remote)
    try:
        urls = ray.get([e.base_url.remote() for e in engines])
        want = ray.get(trainer.digests.remote())
        for version in (1, 2):
            metrics = ray.get(trainer.push.remote(urls, version))
            assert metrics["perf/weight_targets_shm"] == 1 and metrics["perf/weight_targets_broadcast"] == 1
            for engine, url in zip(engines, urls):
                got = ray.get(engine.digests.remote())
                assert {n: got[n] for n in want} == want
                assert httpx.get(url + "/get_weight_version", trust_env=False).json()["weight_version"] == str(version)
        assert metrics["timing/weight_group_setup_s"] == 0  # second update: the broadcast group is reused
        ray.get(trainer.close.remote())
    finally:
        ray.get([e.shutdown.remote() for e in engines])
        for actor in (*engines, trainer):
            ray.kill(actor)


def test_auto_routes_engine_objects_inprocess_and_refuses_unknown_targets():
    from loongsage_plugin_torch.engine import create_engine
    from loongsage_plugin_torch.modeling import TINY_QWEN3
    from loongsage_plugin_torch.transport import auto_sender

    from loongsage_core.config import JobConfig, ModelConfig
    from loongsage_hookspecs import EngineContext

    engine = create_engine(EngineContext(job=JobConfig(model=ModelConfig(config=dict(TINY_QWEN3), tokenizer=TOKENIZER)),
                                         components=None))
    url = engine.start()
    with pytest.raises(ValueError, match="no plugin registry"):
        auto_sender(SENDER)
    sender = auto_sender(auto_context())
    try:
        assert sender.route(engine) == "inprocess"
        assert sender.route(url) == "broadcast"  # this engine has no shm receiver (no plugins given to it)
        with pytest.raises(TypeError, match="engine URL or an engine object"):
            sender.route(42)
        with pytest.raises(Exception, match="get_server_info"):
            sender.route("http://127.0.0.1:9")
        with pytest.raises(ValueError, match="unknown weight_transport_args \\['bucket'\\]"):
            auto_sender(auto_context(), bucket=5)
        metrics = sender.send(((n, t + 1) for n, t in engine.runner.named_tensors().items()), 4, [engine])
        assert metrics["perf/weight_targets_inprocess"] == 1 and engine.weight_version == 4
    finally:
        sender.close()
        engine.shutdown()


@pytest.mark.parametrize("path, body, param", [
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2}, "master_port"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 2,
                                    "world_size": 2}, "rank_offset"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1,
                                    "world_size": 2, "backend": "mpi"}, "backend"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]],
                                          "group_name": "nobody"}, "group_name"),
    ("/update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[2]]}, "names"),
    ("/update_weights_from_distributed", {"load_format": "broadcast", "group_name": "g"}, "bucket"),
    ("/update_weights_from_distributed", {"load_format": "flattened_bucket", "names": []}, "load_format"),
    ("/destroy_weights_update_group", {"group_name": "nobody"}, "group_name"),
])
def test_malformed_group_requests_are_400_naming_the_field(path, body, param):
    from loongsage_plugin_torch.engine import create_engine
    from loongsage_plugin_torch.modeling import TINY_QWEN3

    from loongsage_core.config import JobConfig, ModelConfig
    from loongsage_hookspecs import EngineContext

    engine = create_engine(EngineContext(job=JobConfig(model=ModelConfig(config=dict(TINY_QWEN3), tokenizer=TOKENIZER)),
                                         components=None))
    url = engine.start()
    try:
        response = httpx.post(url + path, json=body, trust_env=False, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        assert httpx.get(url + "/get_weight_version", trust_env=False).json()["weight_version"] == "0"
    finally:
        engine.shutdown()
