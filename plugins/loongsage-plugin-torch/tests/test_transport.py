"""Tests of the weight transports: bucket packing, the shm sender/receiver pair, in-process delivery."""

from __future__ import annotations

import gc
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing import shared_memory

import pytest
import torch
from loongsage_plugin_torch.transport import inprocess_receiver, inprocess_sender, shm_receiver, shm_sender
from loongsage_plugin_torch.transport.buckets import ALIGN, BucketPacker, decode_bucket, encode_bucket
from loongsage_plugin_torch.transport.shm import WeightTransferError, payload_target

from loongsage_hookspecs import WeightReceiver, WeightSender, WeightTransportContext

SENDER = WeightTransportContext(role="sender")
RECEIVER = WeightTransportContext(role="receiver")


def sample_tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(40, 16, generator=g)),                   # 2560 B
        ("model.norm.weight", torch.randn(16, generator=g).to(torch.bfloat16)),            # 32 B
        ("model.layers.0.mlp.up_proj.weight", torch.randn(24, 16, generator=g).to(torch.bfloat16)),
        ("step", torch.tensor(7, dtype=torch.int64)),                                      # 0-dim
        ("positions", torch.arange(-50, 50, dtype=torch.int64).reshape(10, 10)),
        ("flags", torch.rand(13, generator=g) > 0.5),
        ("empty", torch.zeros(0, 4)),
        ("strided", torch.randn(8, 6, generator=g).t()),                                   # not contiguous
        ("nan_and_inf", torch.tensor([float("nan"), float("inf"), -0.0, 1.0])),
    ]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


class Collector:
    """An in-process engine stand-in for the shm receiver: copies what it receives."""

    def __init__(self, **receiver_args):
        self.receiver = shm_receiver(RECEIVER, **receiver_args)
        self.got: dict[str, torch.Tensor] = {}
        self.payloads: list[dict] = []

    def __call__(self, payload):
        self.payloads.append(payload)
        for name, tensor in self.receiver.receive(payload):
            self.got[name] = tensor.clone()


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------


def test_packer_aligns_fills_and_opens_new_buckets():
    packer = BucketPacker(256, split_large=True)
    a = list(packer.place("a", (25,), "float32", 100))
    b = list(packer.place("b", (25,), "float32", 100))
    c = list(packer.place("c", (25,), "float32", 100))  # 128 + 100 = 228 fits, next would not
    d = list(packer.place("d", (16,), "float32", 64))
    assert [(p.bucket, p.offset) for p in a + b + c + d] == [(0, 0), (0, 128), (1, 0), (1, 128)]
    assert all(p.offset % ALIGN == 0 for p in a + b + c + d)
    assert packer.sizes == [228, 192]
    bucket = packer.bucket(1, version=3, last=True)
    assert [t.name for t in bucket.tensors] == ["c", "d"] and bucket.nbytes == 164 and bucket.last


def test_packer_splits_or_isolates_tensors_larger_than_a_bucket():
    split = BucketPacker(256, split_large=True)
    list(split.place("small", (4,), "float32", 16))
    pieces = list(split.place("big", (200,), "float32", 800))
    assert [(p.bucket, p.offset, p.start, p.nbytes) for p in pieces] == [
        (0, 64, 0, 192), (1, 0, 192, 256), (2, 0, 448, 256), (3, 0, 704, 96)]
    assert sum(p.nbytes for p in pieces) == 800 and max(split.sizes) <= 256

    own = BucketPacker(256, split_large=False)
    list(own.place("small", (4,), "float32", 16))
    pieces = list(own.place("big", (200,), "float32", 800))
    after = list(own.place("next", (4,), "float32", 16))
    assert [(p.bucket, p.offset, p.nbytes) for p in pieces] == [(1, 0, 800)]
    assert after[0].bucket == 2 and own.sizes == [16, 800, 16]


def test_bucket_metadata_round_trips():
    packer = BucketPacker(128, split_large=True)
    list(packer.place("w", (2, 3), "bfloat16", 12))
    list(packer.place("big", (64,), "float32", 256))
    text = encode_bucket(packer, 0, version=5, last=False, shm_name="blk", shm_size=128, retired=["old"])
    decoded = decode_bucket([text])
    assert decoded.bucket == packer.bucket(0, version=5, last=False)
    assert decoded.shm_name == "blk" and decoded.retired == ["old"]
    assert [(e.start, e.total_nbytes) for e in decoded.entries] == [(0, 12), (0, 256)]
    assert decoded.entries[1].meta.nbytes == 64
    with pytest.raises(ValueError, match="format"):
        decode_bucket(json.dumps({"format": "other"}))


# ---------------------------------------------------------------------------------------------
# shm sender -> receiver in this process
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split_large", [True, False])
@pytest.mark.parametrize("bucket_bytes", [256, 1024, 1 << 20])
def test_shm_round_trip_is_bit_exact(split_large, bucket_bytes):
    tensors = sample_tensors()
    engine = Collector()
    with shm_sender(SENDER, bucket_bytes=bucket_bytes, split_large=split_large) as sender:
        assert isinstance(sender, WeightSender) and isinstance(engine.receiver, WeightReceiver)
        metrics = sender.send(iter(tensors), 4, [engine])
    assert list(engine.got) == [n for n, _ in tensors]
    for name, t in tensors:
        assert same_bits(engine.got[name], t), name
    buckets = [decode_bucket(p["serialized_named_tensors"]) for p in engine.payloads]
    assert [b.bucket.index for b in buckets] == list(range(len(buckets)))
    assert [p["flush_cache"] for p in engine.payloads] == [False] * (len(buckets) - 1) + [True]
    assert all(p["weight_version"] == 4 and p["load_format"] == "shm" for p in engine.payloads)
    assert metrics["perf/weight_update_buckets"] == len(buckets)
    assert metrics["perf/weight_update_bytes"] == sum(t.numel() * t.element_size() for _, t in tensors)
    if bucket_bytes == 256:
        assert len(buckets) > 5
        split_parts = [e for b in buckets for e in b.entries if e.meta.nbytes != e.total_nbytes]
        assert bool(split_parts) == split_large  # the 2560-byte embedding was cut only when asked
        if not split_large:
            assert max(b.shm_size for b in buckets) >= 2560


def test_shm_blocks_are_reused_across_updates_and_retired_when_grown():
    engine = Collector()
    sender = shm_sender(SENDER, bucket_bytes=4096, num_buffers=2, split_large=False)
    small = [("a", torch.randn(100)), ("b", torch.randn(900)), ("c", torch.randn(300))]
    sender.send(small, 1, [engine])
    names = sorted(sender.block_names)
    sender.send(small, 2, [engine])
    assert sorted(sender.block_names) == names  # same blocks, no new allocation
    assert len(engine.receiver._mappings) == 2

    big = small + [("huge", torch.randn(5000))]  # 20000 B > bucket: grows one block
    sender.send(big, 3, [engine])
    assert len(set(sender.block_names) - set(names)) == 1
    retired = [r for p in engine.payloads for r in decode_bucket(p["serialized_named_tensors"]).retired]
    assert len(retired) == 1 and retired[0] in names and retired[0] not in engine.receiver._mappings
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=retired[0])
    assert same_bits(engine.got["huge"], big[-1][1])
    held = sender.block_names
    sender.close()
    sender.close()
    for name in held:
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=name)


def test_shm_sender_finalizer_unlinks_blocks_when_dropped():
    sender = shm_sender(SENDER, bucket_bytes=1024)
    sender.send(sample_tensors(), 0, [Collector()])
    held = sender.block_names
    assert held
    del sender
    gc.collect()
    for name in held:
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=name)


def test_shm_receiver_copy_mode_and_views():
    tensors = [("w", torch.randn(64, 8))]
    views, copies = [], []
    with shm_sender(SENDER, bucket_bytes=1 << 16) as sender:
        sender.send(tensors, 0, [payload_target(shm_receiver(RECEIVER), lambda n, t: views.append(t)),
                                 payload_target(shm_receiver(RECEIVER, copy=True), lambda n, t: copies.append(t))])
        assert torch.equal(views[0], tensors[0][1]) and torch.equal(copies[0], tensors[0][1])
        sender.send([("w", torch.zeros(64, 8))], 1, [lambda p: None])
        assert torch.count_nonzero(views[0]) == 0  # a view follows the reused block
        assert torch.equal(copies[0], tensors[0][1])  # a copy does not


def test_shm_empty_update_still_announces_the_version():
    engine = Collector()
    with shm_sender(SENDER) as sender:
        metrics = sender.send([], 9, [engine])
    assert len(engine.payloads) == 1 and engine.payloads[0]["weight_version"] == 9
    assert engine.payloads[0]["flush_cache"] is True and engine.got == {}
    assert metrics["perf/weight_update_bytes"] == 0


def test_shm_receiver_reports_incomplete_split_tensors():
    payloads = []
    with shm_sender(SENDER, bucket_bytes=256, split_large=True) as sender:
        sender.send([("big", torch.randn(200))], 0, [payloads.append])
        receiver = shm_receiver(RECEIVER)
        last = payloads[-1]
        with pytest.raises(ValueError, match="incomplete"):
            list(receiver.receive(last))


def test_bad_arguments_and_targets():
    with pytest.raises(ValueError, match="bucket_bytes"):
        shm_sender(SENDER, bucket_bytes=8)
    with pytest.raises(TypeError):
        shm_sender(SENDER, bucket_size=1024)
    with shm_sender(SENDER) as sender, pytest.raises(TypeError, match="base URL or a callable"):
        sender.send([("w", torch.ones(2))], 0, [42])
    with pytest.raises(ValueError, match="load_format"):
        list(shm_receiver(RECEIVER).receive({"load_format": "disk", "serialized_named_tensors": "{}"}))


def test_shm_http_errors_name_the_engine():
    class Failing(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server API
            self.rfile.read(int(self.headers["Content-Length"]))
            status, body = (200, {"success": False, "message": "version mismatch"}) \
                if self.path == "/update_weights_from_tensor" else (404, {})
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with shm_sender(SENDER) as sender:
            with pytest.raises(WeightTransferError, match=f"{url} rejected weight version 3: version mismatch"):
                sender.send([("w", torch.ones(4))], 3, [url])
            with pytest.raises(WeightTransferError, match="answered 404"):
                sender.send([("w", torch.ones(4))], 3, [url + "/nope"])
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------------------------------
# inprocess
# ---------------------------------------------------------------------------------------------


class Engine:
    """An object with the engine's ``load_weights(weights, version)`` method."""

    def __init__(self, tensors):
        self.params = {n: torch.zeros_like(t) for n, t in tensors}
        self.seen: list[torch.Tensor] = []
        self.version = -1

    def load_weights(self, weights, version):
        for name, tensor in weights:
            self.seen.append(tensor)
            self.params[name].copy_(tensor)
        self.version = version


def test_inprocess_sender_hands_the_same_tensors_to_every_engine():
    tensors = sample_tensors()
    engines = [Engine(tensors), Engine(tensors)]
    sender = inprocess_sender(SENDER)
    metrics = sender.send((pair for pair in tensors), 6, engines)
    for engine in engines:
        assert engine.version == 6
        assert all(a is b for a, (_, b) in zip(engine.seen, tensors))  # no transport copy
        for name, t in tensors:
            assert same_bits(engine.params[name], t.contiguous()), name
    assert metrics["perf/weight_update_bytes"] == sum(t.numel() * t.element_size() for _, t in tensors)
    with pytest.raises(TypeError, match="load_weights"):
        sender.send(tensors, 7, [object()])
    assert list(inprocess_receiver(RECEIVER).receive({"named_tensors": tensors[:2]})) == tensors[:2]


def test_blocks_of_killed_senders_are_reclaimed(tmp_path):
    """A run killed with SIGKILL (its whole process tree, Python's resource tracker too) cannot
    unlink its blocks; the next sender on the node does."""
    import subprocess
    import sys

    from loongsage_plugin_torch.transport import shm

    # the child's block is unknown to its resource tracker, which would otherwise unlink it once
    # the child dies: what is left is exactly what a killed process tree leaves
    code = ("import time; from multiprocessing import resource_tracker, shared_memory; "
            "from loongsage_plugin_torch.transport.shm import _block_name; "
            "b = shared_memory.SharedMemory(name=_block_name(), create=True, size=4096); "
            "resource_tracker.unregister(b._name, 'shared_memory'); "
            "print(b.name, flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    orphan = child.stdout.readline().strip()
    child.kill()
    child.wait()
    assert orphan.startswith(shm.BLOCK_PREFIX)
    alive = shared_memory.SharedMemory(name=shm._block_name(), create=True, size=4096)  # this process lives
    try:
        # (another test's sender running beside this one may reclaim the orphan first: same result)
        with shm.ShmSender(bucket_bytes=1024):
            pass
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=orphan)
        shared_memory.SharedMemory(name=alive.name).close()  # a live sender's block is kept
    finally:
        alive.close()
        alive.unlink()

    # which names are judged, on a directory of its own: a dead sender's, a live one's, a stranger
    dead = f"{shm.BLOCK_PREFIX}{child.pid}_0a"
    live = f"{shm.BLOCK_PREFIX}{os.getpid()}_0b"
    for name in (dead, live, f"{shm.BLOCK_PREFIX}notapid_0c", "other_block"):
        (tmp_path / name).write_bytes(b"x")
    assert shm.reclaim_orphan_blocks(str(tmp_path)) == [dead]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live, f"{shm.BLOCK_PREFIX}notapid_0c", "other_block"])
