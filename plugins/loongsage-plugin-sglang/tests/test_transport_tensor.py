"""``sglang_tensor``: tensor handles into an engine in another process (shared memory on the CPU).

SGLang's ``update_weights_from_tensor`` format carries ``torch.multiprocessing`` handles; on a
GPU they are CUDA IPC handles (scripts/gpu_check.sh), on the CPU shared-memory file names, which
is what these tests send: into the torch plugin's embedded engine over HTTP, and into a plain
decoding process to check the bytes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys

import httpx
import pytest
import torch
from loongsage_plugin_sglang.transport_tensor import TensorHandleSender, serialize_named_tensors


def digest(t: torch.Tensor) -> list:
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return [hashlib.sha256(raw).hexdigest(), str(t.dtype).removeprefix("torch."), list(t.shape)]


DECODE = """
import base64, hashlib, json, sys, torch
from loongsage_plugin_torch.engine.weights import decode_direct
def digest(t):
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return [hashlib.sha256(raw).hexdigest(), str(t.dtype).removeprefix("torch."), list(t.shape)]
payload = json.loads(sys.stdin.read())
print(json.dumps({name: digest(t) for name, t in decode_direct(payload)}))
"""


def test_handles_reach_another_process_bit_exact():
    g = torch.Generator().manual_seed(0)
    named = [("embed", torch.randn(40, 16, generator=g)), ("norm", torch.randn(16, generator=g).bfloat16()),
             ("proj", torch.randn(16, 8, generator=g).half().t()), ("ids", torch.arange(33)),
             ("scale", torch.tensor(0.25, dtype=torch.float64))]
    sender = TensorHandleSender(bucket_bytes=1 << 16)
    views = sender._pack(named, 0)
    for (_, view), (_, tensor) in zip(views, named):  # views share one staging buffer
        assert view.untyped_storage().data_ptr() == views[0][1].untyped_storage().data_ptr()
        assert torch.equal(view, tensor)
    text = serialize_named_tensors(views)
    assert len(text) < 4096  # handles, not the ~3.6 KB of bytes plus base64
    payload = {"serialized_named_tensors": [text]}
    out = subprocess.run([sys.executable, "-c", DECODE], input=json.dumps(payload), capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {n: digest(t) for n, t in named}
    sender.close()


SLOW_MANAGER = """
import json, sys, torch
from loongsage_plugin_torch.engine.weights import decode_direct
real, failures = torch.UntypedStorage._new_shared_filename_cpu, [1, 1]
def slow_manager(*args, **kwargs):
    if failures:
        failures.pop()
        raise RuntimeError("Shared memory manager connection has timed out")
    return real(*args, **kwargs)
torch.UntypedStorage._new_shared_filename_cpu = slow_manager
[(name, tensor)] = decode_direct(json.loads(sys.stdin.read()))
print(json.dumps([name, tensor.tolist(), failures]))
"""


def test_a_slow_shared_memory_manager_is_retried_on_both_sides(monkeypatch):
    """torch's shm manager must answer within a second; a loaded machine's late answer is retried."""
    from multiprocessing.reduction import ForkingPickler

    real, failures = ForkingPickler.dump, [1, 1]

    def slow_manager(*args, **kwargs):
        if failures:
            failures.pop()
            raise RuntimeError("Shared memory manager connection has timed out\nException raised from recv")
        return real(*args, **kwargs)

    weight = torch.randn(4, 3)
    monkeypatch.setattr(ForkingPickler, "dump", slow_manager)
    text = serialize_named_tensors([("w", weight)])
    assert failures == []
    out = subprocess.run([sys.executable, "-c", SLOW_MANAGER], input=json.dumps({"serialized_named_tensors": text}),
                         capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["w", weight.tolist(), []]  # opened after two timed-out tries
    failures.extend([1] * 5)
    with pytest.raises(RuntimeError, match="timed out"):  # a manager that never answers still fails
        serialize_named_tensors([("w", weight)])


def test_sglang_tensor_updates_an_embedded_engine(embedded_engine_process, trainer_model):
    from sglang_test_support import assert_engine_scores_like

    url = embedded_engine_process
    named = [(n, p.detach()) for n, p in trainer_model.named_parameters()]
    sender = TensorHandleSender(bucket_bytes=8192, num_buffers=2)
    try:
        stats = sender.send(iter(named), 4, [url])
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        assert stats["perf/weight_update_bytes"] == nbytes and stats["perf/weight_update_buckets"] > 2
        assert httpx.get(url + "/get_weight_version", trust_env=False).json()["weight_version"] == "4"
        assert_engine_scores_like(url, trainer_model)
        # a second update reuses the two staging buffers
        buffers = [b.untyped_storage().data_ptr() for b in sender._buffers]
        sender.send(iter(named), 5, [url])
        assert [b.untyped_storage().data_ptr() for b in sender._buffers] == buffers
        assert httpx.get(url + "/get_weight_version", trust_env=False).json()["weight_version"] == "5"
    finally:
        sender.close()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="bucket_bytes"):
        TensorHandleSender(bucket_bytes=8)
    with pytest.raises(ValueError, match="num_buffers and tp_size"):
        TensorHandleSender(tp_size=0)
    with pytest.raises(TypeError, match="sglang_tensor weight transport"):
        TensorHandleSender().send([("a", torch.zeros(2))], 1, [object()])


def test_engine_refuses_a_pickle_that_is_not_tensor_handles():
    """A request body must not be able to run code in the engine."""
    from loongsage_plugin_torch.engine.weights import WeightUpdateError, decode_direct

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo should-not-run",))

    import pickle

    text = base64.b64encode(pickle.dumps([("w", Evil())])).decode()
    with pytest.raises(WeightUpdateError, match="only torch tensor handles are accepted"):
        list(decode_direct({"serialized_named_tensors": [text]}))
