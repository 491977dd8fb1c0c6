"""The shm weight transport across real processes: receivers serve HTTP in child processes.

Run as a script (``python test_transport_process.py N``) this file is the child: N small HTTP
servers (one per simulated engine, each with its own ``shm`` receiver) behind
``/update_weights_from_tensor`` that record a digest of every tensor received and report them on
``GET /digests``. One child process hosts both engines to keep the test's start-up short.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing import shared_memory

import httpx
import pytest
import torch

from loongsage_hookspecs import WeightTransportContext

SENDER = WeightTransportContext(role="sender")
RECEIVER = WeightTransportContext(role="receiver")


def digest(t: torch.Tensor) -> list:
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return [hashlib.sha256(raw).hexdigest(), str(t.dtype).removeprefix("torch."), list(t.shape)]


def make_server() -> ThreadingHTTPServer:
    """An engine-shaped HTTP endpoint around its own ShmReceiver."""
    from loongsage_plugin_torch.transport import shm_receiver

    receiver = shm_receiver(RECEIVER)
    state: dict = {"digests": {}, "versions": [], "flushes": 0}

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):  # noqa: N802 - http.server API
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/update_weights_from_tensor":
                return self._reply(404, {"success": False, "message": self.path})
            try:
                for name, tensor in receiver.receive(payload):
                    state["digests"][name] = digest(tensor)
            except Exception as exc:  # report to the sender like an engine would
                return self._reply(400, {"success": False, "message": repr(exc)})
            state["versions"].append(payload["weight_version"])
            state["flushes"] += bool(payload["flush_cache"])
            return self._reply(200, {"success": True, "message": "ok"})

        def do_GET(self):  # noqa: N802
            if self.path == "/shutdown":
                self._reply(200, {})
                threading.Thread(target=self.server.shutdown).start()
                return
            self._reply(200, state)

        def log_message(self, *args):
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


def serve(count: int) -> None:
    """Child process: ``count`` engine endpoints; prints their ports, runs until all are shut down."""
    servers = [make_server() for _ in range(count)]
    threads = [threading.Thread(target=s.serve_forever) for s in servers]
    for t in threads:
        t.start()
    print(" ".join(str(s.server_address[1]) for s in servers), flush=True)
    for t in threads:
        t.join()


def start_child(count: int) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen([sys.executable, __file__, str(count)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True)
    line = proc.stdout.readline()
    if not line.strip():
        proc.kill()
        raise RuntimeError(f"receiver child failed to start: {proc.stderr.read()[-2000:]}")
    return proc, [f"http://127.0.0.1:{int(port)}" for port in line.split()]


@pytest.mark.slow
def test_shm_transport_into_two_engine_processes_is_bit_exact():
    g = torch.Generator().manual_seed(0)
    first = [("embed", torch.randn(300, 64, generator=g)),                        # 76800 B: split across buckets
             ("norm", torch.randn(64, generator=g).to(torch.bfloat16)),
             ("proj", torch.randn(32, 64, generator=g).to(torch.bfloat16)),
             ("ids", torch.arange(1000, dtype=torch.int64)),
             ("scale", torch.tensor(0.5))]
    second = [(n, t + 1 if t.is_floating_point() else t * 2) for n, t in first]
    child, urls = start_child(2)
    try:
        from loongsage_plugin_torch.transport import shm_sender

        sender = shm_sender(SENDER, bucket_bytes=16384, split_large=True, num_buffers=2)
        for version, tensors in ((1, first), (2, second)):
            metrics = sender.send(tensors, version, urls)
            assert metrics["perf/weight_update_buckets"] >= 6
            for url in urls:
                state = httpx.get(url + "/digests", trust_env=False).json()
                assert state["digests"] == {n: digest(t) for n, t in tensors}
                assert state["flushes"] == version
        blocks = sender.block_names
        assert len(blocks) == 2

        with shm_sender(SENDER, bucket_bytes=256, split_large=False) as other:  # a tensor gets its own bucket
            other.send(first, 3, urls[:1])
        assert httpx.get(urls[0] + "/digests", trust_env=False).json()["digests"] == {n: digest(t) for n, t in first}
    finally:
        try:
            for url in urls:
                httpx.get(url + "/shutdown", trust_env=False)
            _, err = child.communicate(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
    assert child.returncode == 0, err
    assert "leaked" not in err and "Traceback" not in err, err
    for name in blocks:  # exiting receivers did not unlink the sender's blocks
        shared_memory.SharedMemory(name=name).close()
    sender.close()
    for name in blocks:
        try:
            shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            continue
        raise AssertionError(f"block {name} survived close()")


if __name__ == "__main__":
    serve(int(sys.argv[1]))
