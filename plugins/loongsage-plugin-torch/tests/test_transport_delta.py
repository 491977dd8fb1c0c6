"""Delta weight sync (``delta = true``): equal to a full sync, checked by checksums, healed in full.

Real embedded engines served over HTTP in this process, the real ``shm`` sender and receiver
(bound through the plugin host, so the engine's precision comes from the job), float32 master
weights moved by AdamW steps, a bfloat16 engine. A run through the controller:
``tests/test_weight_sync_delta.py``.
"""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import pytest
import torch
from loongsage_plugin_torch.engine import create_engine
from loongsage_plugin_torch.modeling import TINY_QWEN3
from loongsage_plugin_torch.transport.delta import MISMATCH_MARK, DeltaMismatchError, checksum
from loongsage_plugin_torch.transport.shm import ShmReceiver, ShmSender, payload_target

from loongsage_core.backend_api.serving import engine_headers
from loongsage_core.config import JobConfig, ModelConfig, RolloutConfig
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import EngineContext, WeightTransportContext

JOB = JobConfig(model=ModelConfig(config=dict(TINY_QWEN3)), rollout=RolloutConfig(engine_args={"dtype": "bfloat16"}))


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost.create(["torch", "sglang"])


@pytest.fixture
def engines(host) -> Iterator[list[Any]]:
    started: list[Any] = []

    def start() -> Any:
        engine = create_engine(EngineContext(job=JOB, components=host))
        engine.start()
        started.append(engine)
        return engine

    yield start  # type: ignore[misc]
    for engine in started:
        engine.shutdown()


def sender(host: PluginHost, **args: Any) -> Any:
    return host.get("weight_transport", "shm").sender(WeightTransportContext(role="sender", job=JOB),
                                                      bucket_bytes=1 << 16, **args)


class Trainer:
    """float32 master weights shaped like the engine's model, moved by AdamW on random targets."""

    def __init__(self, engine: Any, lr: float) -> None:
        torch.manual_seed(0)
        self.params = {n: torch.nn.Parameter(p.detach().float().clone()) for n, p in engine.model.named_parameters()}
        self.opt = torch.optim.AdamW(self.params.values(), lr=lr)

    def step(self) -> None:
        self.opt.zero_grad()
        loss = sum(((p - torch.randn_like(p)) ** 2).mean() for p in self.params.values())
        loss.backward()
        self.opt.step()

    def weights(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.params.items()]


def engine_state(engine: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in engine.model.named_parameters()}


def test_delta_syncs_over_adamw_steps_equal_a_full_sync_bit_for_bit(host, engines):
    full_engine, delta_engine = engines(), engines()
    trainer = Trainer(full_engine, lr=1e-5)
    full, delta = sender(host), sender(host, delta=True, full_every=0)
    ratios = []
    try:
        for version in range(1, 6):
            trainer.step()
            full_metrics = full.send(iter(trainer.weights()), version, [full_engine.base_url])
            metrics = delta.send(iter(trainer.weights()), version, [delta_engine.base_url])
            ratios.append(metrics["perf/weight_sync_delta_ratio"])
            assert metrics["perf/weight_sync_full"] == float(version == 1)
            assert full_metrics["perf/weight_sync_delta_ratio"] == 1.0
            a, b = engine_state(full_engine), engine_state(delta_engine)
            assert all(torch.equal(a[n], b[n]) for n in a)
            assert delta_engine.weight_version == version
    finally:
        full.close()
        delta.close()
    # the engine is bfloat16: the delta is taken there (a float32 full sync would move twice the bytes)
    bf16_bytes = sum(p.numel() * 2 for _, p in trainer.weights())
    assert ratios[0] == 1.0 and all(0.0 < r < 0.5 for r in ratios[1:]), ratios
    assert metrics["perf/weight_sync_bytes"] == pytest.approx(ratios[-1] * bf16_bytes)
    encodings = set(delta.delta.last_encodings.values())
    assert encodings & {"sparse", "xor_zstd"}, encodings


def test_a_corrupted_delta_is_refused_then_healed_by_a_full_sync(host, engines):
    engine = engines()
    trainer = Trainer(engine, lr=1e-5)
    tx = sender(host, delta=True, full_every=0)
    url = engine.base_url
    try:
        trainer.step()
        tx.send(iter(trainer.weights()), 1, [url])
        trainer.step()
        # the engine's copy of what it last received goes bad (a bit flips)
        held = engine._receivers["shm"]._delta.held
        name = "model.layers.0.mlp.up_proj.weight"
        bad = held[name].clone()
        bad[100] ^= 0x10
        held[name] = bad
        metrics = tx.send(iter(trainer.weights()), 2, [url])
        assert metrics["perf/weight_sync_fallbacks"] == 1.0 and metrics["perf/weight_sync_full"] == 1.0
        assert metrics["perf/weight_sync_delta_ratio"] > 1.0  # the delta, then the whole model
        got = engine_state(engine)
        assert all(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in trainer.weights())
        assert engine.weight_version == 2
        # the sender's record of what engines hold goes bad: the next delta is rebuilt wrong, refused, healed
        trainer.step()
        tx.delta.last_sent[name][0][7] ^= 0x01
        metrics = tx.send(iter(trainer.weights()), 3, [url])
        assert metrics["perf/weight_sync_fallbacks"] == 1.0
        got = engine_state(engine)
        assert all(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in trainer.weights())
        # and the next sync is a delta again
        trainer.step()
        metrics = tx.send(iter(trainer.weights()), 4, [url])
        assert metrics["perf/weight_sync_full"] == 0.0 and metrics["perf/weight_sync_fallbacks"] == 0.0
    finally:
        tx.close()


def test_a_tensor_corrupted_in_transit_never_reaches_the_engine():
    """The shared-memory block is damaged between the sender and the receiver: the receiver raises
    the mismatch, the tensor is not handed on, and the full resend lands."""
    torch.manual_seed(0)
    master = {"a": torch.randn(256, 64) * 0.02, "b": torch.randn(4096) * 0.02}
    received: list[tuple[int, str, torch.Tensor]] = []
    rx = ShmReceiver()
    tx = ShmSender(bucket_bytes=1 << 16, delta=True, full_every=0)
    version = 0
    deliver = payload_target(rx, lambda n, t: received.append((version, n, t.clone())))
    damaged = []

    def damaging(payload: dict) -> None:
        if version == 2 and not damaged:  # the first delta bucket of version 2
            block = next(b for b in tx._blocks if b is not None and b.name in payload["serialized_named_tensors"])
            block.buf[0] ^= 0xFF
            damaged.append(True)
        deliver(payload)

    expected = {}
    try:
        for version in (1, 2):
            for t in master.values():
                t.add_(torch.randn_like(t) * 1e-4)
            weights = [(n, t.to(torch.bfloat16)) for n, t in master.items()]
            expected[version] = dict(weights)
            metrics = tx.send(iter(weights), version, [damaging])
        assert damaged and metrics["perf/weight_sync_fallbacks"] == 1.0
        for v, name, tensor in received:  # nothing handed on differs from the version's true weights
            assert torch.equal(tensor, expected[v][name]), (v, name)
        assert {n for v, n, _ in received if v == 2} == set(master)
    finally:
        tx.close()


def test_full_every_sends_the_whole_model_every_n_versions(host, engines):
    engine = engines()
    trainer = Trainer(engine, lr=1e-5)
    tx = sender(host, delta=True, full_every=3)
    try:
        fulls = []
        for version in range(1, 8):
            trainer.step()
            fulls.append(tx.send(iter(trainer.weights()), version, [engine.base_url])["perf/weight_sync_full"])
        assert fulls == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    finally:
        tx.close()


def test_a_new_engine_without_a_base_gets_the_version_in_full(host, engines):
    first, second = engines(), engines()
    trainer = Trainer(first, lr=1e-5)
    tx = sender(host, delta=True, full_every=0)
    try:
        trainer.step()
        tx.send(iter(trainer.weights()), 1, [first.base_url])
        trainer.step()
        metrics = tx.send(iter(trainer.weights()), 2, [first.base_url, second.base_url])
        assert metrics["perf/weight_sync_fallbacks"] == 1.0
        a, b = engine_state(first), engine_state(second)
        assert all(torch.equal(a[n], b[n]) for n in a)
    finally:
        tx.close()


def test_the_engine_answers_400_naming_the_mismatch(host, engines):
    """What a sender sees: the engine refuses the request with the mismatch in its message."""
    engine = engines()
    rx_payload = {"load_format": "shm", "weight_version": 1, "flush_cache": True,
                  "serialized_named_tensors": '{"format": "loongsage.bucket.v1", "version": 1, "index": 0, '
                  '"last": true, "size": 0, "tensors": [{"name": "model.norm.weight", "shape": [0], '
                  '"dtype": "uint8", "offset": 0, "nbytes": 0, "part_start": 0, "total_nbytes": 0}], '
                  '"delta": {"model.norm.weight": {"encoding": "same", "shape": [32], "dtype": "bfloat16", '
                  '"nbytes": 64, "checksum": "0"}}}'}
    response = httpx.post(engine.base_url + "/update_weights_from_tensor", json=rx_payload,
                          headers=engine_headers(), trust_env=False, timeout=30)
    assert response.status_code == 400
    assert MISMATCH_MARK in response.json()["error"]["message"] and "model.norm.weight" in response.text


def test_checksums_are_of_the_bytes():
    data = torch.arange(64, dtype=torch.uint8)
    other = data.clone()
    other[3] ^= 1
    assert checksum(data) == checksum(data.clone()) != checksum(other)
    assert issubclass(DeltaMismatchError, ValueError)


@pytest.mark.parametrize("transport", ["inprocess", "sglang_disk", "sglang_nccl", "sglang_tensor"])
def test_transports_without_delta_refuse_the_key(host, transport):
    spec = host.get("weight_transport", transport)
    with pytest.raises(ValueError, match=rf"{transport} weight transport: weight_transport_args.delta = true is not "
                                         r"supported: .*shm and broadcast"):
        spec.sender(WeightTransportContext(role="sender", job=JOB), delta=True)


def test_each_encoding_rebuilds_the_exact_bytes():
    """One changed element travels as an index and a value, a dense change as zstd'd XOR, no change
    as nothing; every dtype the engine may hold comes back bit for bit."""
    torch.manual_seed(0)
    weights = {"one": torch.randn(4096).to(torch.bfloat16), "dense": torch.randn(64, 64),
               "still": torch.randn(512).half(), "ids": torch.arange(300, dtype=torch.int64)}
    got: dict[str, torch.Tensor] = {}
    rx = ShmReceiver()
    tx = ShmSender(bucket_bytes=1 << 12, delta=True, full_every=0)  # small buckets: tensors split across them
    target = payload_target(rx, lambda n, t: got.__setitem__(n, t.clone()))
    try:
        tx.send(iter(weights.items()), 1, [target])
        weights["one"][17] += 1
        weights["dense"][::2] += 1e-3
        weights["ids"][5] = -1
        tx.send(iter(weights.items()), 2, [target])
        assert tx.delta.last_encodings == {"one": "sparse", "dense": "xor_zstd", "still": "same", "ids": "sparse"}
        for name, tensor in weights.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    finally:
        tx.close()


def test_auto_carries_the_delta_of_the_transport_it_picks(host, engines):
    """``auto`` (the default transport) with ``{ shm = { delta = true } }``: the engine gets shm, and
    the step's metrics keep the delta's bytes and ratio."""
    engine = engines()
    trainer = Trainer(engine, lr=1e-5)
    ctx = WeightTransportContext(role="sender", job=JOB, components=host, where="job.toml: rollout.weight_transport")
    tx = host.get("weight_transport", "auto").sender(ctx, shm={"delta": True, "bucket_bytes": 1 << 16})
    try:
        metrics = []
        for version in (1, 2):
            trainer.step()
            metrics.append(tx.send(iter(trainer.weights()), version, [engine.base_url]))
        assert metrics[1]["perf/weight_targets_shm"] == 1.0
        assert [m["perf/weight_sync_full"] for m in metrics] == [1.0, 0.0]
        ratio = metrics[1]["perf/weight_sync_delta_ratio"]
        assert metrics[0]["perf/weight_sync_delta_ratio"] == 1.0 and 0.0 < ratio < 1.0
        assert metrics[1]["perf/weight_sync_bytes"] == pytest.approx(ratio * metrics[1]["perf/weight_sync_full_bytes"])
        got = engine_state(engine)
        assert all(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in trainer.weights())
    finally:
        tx.close()
