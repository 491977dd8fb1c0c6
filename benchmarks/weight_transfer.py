"""Weight-transfer throughput: ``inprocess``, ``shm`` and ``broadcast`` transports against a plain copy.

Builds a synthetic set of weights (float32 embedding, bfloat16 layer matrices), then measures,
side by side in one run:

* ``plain_copy``: ``dst.copy_(src)`` of every tensor into preallocated tensors (the floor any
  transport pays once, since an engine copies into its parameters);
* ``inprocess``: the ``inprocess`` sender into an in-process engine object doing that copy;
* ``shm``: the ``shm`` sender into an engine in another process (an HTTP endpoint with the
  ``shm`` receiver copying into its parameters), for several bucket sizes;
* ``broadcast``: the ``broadcast`` sender into the same process over a Gloo group (metadata by
  HTTP, bytes by ``torch.distributed.broadcast`` over loopback TCP), for the same bucket sizes;
* ``handles``: the sglang plugin's ``sglang_tensor`` sender (``torch.multiprocessing`` handles to
  a shared staging bucket; CUDA IPC on a GPU), same bucket sizes.

Prints JSON with bytes/s and the ratio of each transport to the plain copy (absolute numbers are
not stable on a shared machine; the ratios are the result). Run::

    python benchmarks/weight_transfer.py [--total-mb 128] [--repeats 3] [--buckets-mb 4,16,64]

``--delta`` measures delta sync instead (``shm`` with ``delta = true`` against a full ``shm``
sync, into another process): a model shaped like SmolLM2-135M (built from its config, random
init, float32 master weights) takes AdamW steps on random tokens at each learning rate; after
every step both senders push the weights to a bfloat16 engine. Prints, per learning rate,
``delta_bytes_ratio`` (bytes a delta sync moved / bytes of a full bfloat16 sync, mean over the
steps after the first) and the seconds per sync of each::

    python benchmarks/weight_transfer.py --delta [--steps 4] [--lrs 1e-6,1e-5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def synthetic_weights(total_mb: int) -> list:
    """Named tensors of about ``total_mb`` MiB shaped like a small transformer's."""
    import torch

    hidden = 1024
    g = torch.Generator().manual_seed(0)
    weights = [("model.embed_tokens.weight", torch.randn(4096, hidden, generator=g))]  # 16 MiB float32
    layer = 0
    while sum(t.numel() * t.element_size() for _, t in weights) < total_mb << 20:
        prefix = f"model.layers.{layer}"
        for name, shape in (("self_attn.q_proj", (hidden, hidden)), ("self_attn.k_proj", (hidden // 4, hidden)),
                            ("self_attn.v_proj", (hidden // 4, hidden)), ("self_attn.o_proj", (hidden, hidden)),
                            ("mlp.gate_proj", (2816, hidden)), ("mlp.up_proj", (2816, hidden)),
                            ("mlp.down_proj", (hidden, 2816))):
            weights.append((f"{prefix}.{name}.weight", torch.randn(*shape, generator=g).to(torch.bfloat16)))
        weights.append((f"{prefix}.input_layernorm.weight", torch.ones(hidden, dtype=torch.bfloat16)))
        layer += 1
    return weights


class CopyEngine:
    """An engine stand-in that copies received tensors into its own preallocated parameters."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.params: dict = {}
        self.version = -1

    def load_weights(self, weights, version) -> None:
        for name, tensor in weights:
            dst = self.params.get(name)
            if dst is None:
                dst = self.params[name] = self.torch.empty_like(tensor)
            dst.copy_(tensor)
        self.version = version


def serve() -> None:
    """Child process: an HTTP endpoint whose shm and broadcast receivers feed a CopyEngine."""
    import torch
    from loongsage_plugin_torch.engine.weights import decode_direct
    from loongsage_plugin_torch.transport import broadcast_receiver, shm_receiver

    from loongsage_hookspecs import WeightTransportContext

    torch.set_num_threads(1)
    receiver = shm_receiver(WeightTransportContext(role="receiver"))
    groups = broadcast_receiver(WeightTransportContext(role="receiver"))
    engine = CopyEngine()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server API
            payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/init_weights_update_group":
                groups.join(payload["master_address"], payload["master_port"], payload["rank_offset"],
                            payload["world_size"], group_name=payload["group_name"], backend=payload["backend"])
            elif self.path == "/destroy_weights_update_group":
                groups.leave(payload["group_name"])
            elif self.path == "/update_weights_from_distributed":
                with groups.lock(payload["group_name"]):
                    engine.load_weights(groups.receive(payload), payload["weight_version"])
            elif payload.get("load_format") is None:  # SGLang's tensor-handle format
                engine.load_weights(decode_direct(payload), payload.get("weight_version"))
            else:
                engine.load_weights(receiver.receive(payload), payload["weight_version"])
            self._reply({"success": True})

        def do_GET(self):  # noqa: N802
            self._reply({"version": engine.version})
            if self.path == "/shutdown":
                threading.Thread(target=self.server.shutdown).start()

        def _reply(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


SMOLLM2_135M = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                    tie_word_embeddings=True, initializer_range=0.041666666666666664)
"""HuggingFaceTB/SmolLM2-135M's ``config.json`` (the shapes; the weights are a random init)."""


def unique_weights(model, dtype=None):
    """The model's tensors once each (tied ones under their first name), cast to ``dtype`` if given:
    what a trainer's ``named_weights`` yields."""
    seen: set[int] = set()
    for name, p in model.state_dict(keep_vars=True).items():
        if id(p) not in seen:
            seen.add(id(p))
            yield name, p.detach() if dtype is None else p.detach().to(dtype)


def delta_benchmark(steps: int, lrs: list[float], url: str) -> dict:
    """Per learning rate: AdamW steps on random tokens, each followed by a full and a delta sync."""
    import torch
    from loongsage_plugin_torch.transport import shm_sender
    from transformers import AutoConfig, AutoModelForCausalLM

    from loongsage_core.config import JobConfig, RolloutConfig
    from loongsage_hookspecs import WeightTransportContext

    ctx = WeightTransportContext(role="sender", job=JobConfig(rollout=RolloutConfig(engine_args={"dtype": "bfloat16"})))
    config = AutoConfig.for_model(**SMOLLM2_135M)
    results: dict = {"model": "SmolLM2-135M shapes, random init, float32 master, bfloat16 engine",
                     "steps": steps, "batch": "4 x 128 random tokens"}
    for lr in lrs:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=lr)

        full = shm_sender(ctx)
        delta = shm_sender(ctx, delta=True, full_every=0)
        row: dict = {"params": params, "full_bytes": 0, "delta_bytes_ratio_per_step": [], "full_s": [], "delta_s": []}
        try:
            full.send(unique_weights(model, torch.bfloat16), 0, [url])
            first = delta.send(unique_weights(model), 0, [url])  # the first delta sync is full
            row["first_delta_sync_s"] = first["timing/weight_update_s"]
            for step in range(1, steps + 1):
                ids = torch.randint(0, config.vocab_size, (4, 128))
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                start = time.perf_counter()
                m_full = full.send(unique_weights(model, torch.bfloat16), step, [url])
                row["full_s"].append(time.perf_counter() - start)
                start = time.perf_counter()
                m_delta = delta.send(unique_weights(model), step, [url])
                row["delta_s"].append(time.perf_counter() - start)
                row["full_bytes"] = int(m_full["perf/weight_sync_bytes"])
                row["delta_bytes_ratio_per_step"].append(m_delta["perf/weight_sync_delta_ratio"])
                assert m_delta["perf/weight_sync_full"] == 0.0 and m_delta["perf/weight_sync_fallbacks"] == 0.0
            row["encodings"] = {k: list(delta.delta.last_encodings.values()).count(k)
                                for k in ("same", "sparse", "xor_zstd", "full")}
        finally:
            full.close()
            delta.close()
        ratios = row["delta_bytes_ratio_per_step"]
        row["delta_bytes_ratio"] = sum(ratios) / len(ratios)
        row["seconds_per_sync"] = {"full": sum(row["full_s"]) / steps, "delta": sum(row["delta_s"]) / steps}
        results[f"lr={lr:g}"] = row
        del model, opt
    return results


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mb", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--buckets-mb", default="4,16,64")
    parser.add_argument("--delta", action="store_true", help="delta sync vs full sync on a SmolLM2-135M shape")
    parser.add_argument("--steps", type=int, default=4, help="--delta: AdamW steps per learning rate")
    parser.add_argument("--lrs", default="1e-6,1e-5", help="--delta: learning rates")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    if args.delta:
        child = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            url = f"http://127.0.0.1:{int(child.stdout.readline())}"
            results = delta_benchmark(args.steps, [float(x) for x in args.lrs.split(",")], url)
            import httpx

            httpx.get(url + "/shutdown", trust_env=False)
            child.wait(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
        print(json.dumps(results, indent=2))
        return

    import httpx
    import torch
    from loongsage_plugin_torch.transport import broadcast_sender, inprocess_sender, shm_sender

    from loongsage_hookspecs import WeightTransportContext

    torch.set_num_threads(1)
    weights = synthetic_weights(args.total_mb)
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    dst = [torch.empty_like(t) for _, t in weights]

    def plain_copy() -> None:
        for d, (_, t) in zip(dst, weights):
            d.copy_(t)

    plain_copy()
    results: dict = {"bytes": nbytes, "tensors": len(weights), "repeats": args.repeats}
    copy_s = best_time(plain_copy, args.repeats)
    results["plain_copy"] = {"seconds": copy_s, "gb_per_s": nbytes / copy_s / 1e9}

    engine = CopyEngine()
    inproc = inprocess_sender(WeightTransportContext(role="sender"))
    inproc.send(weights, 0, [engine])
    t = best_time(lambda: inproc.send(weights, 1, [engine]), args.repeats)
    results["inprocess"] = {"seconds": t, "gb_per_s": nbytes / t / 1e9, "ratio_vs_copy": copy_s / t}

    child = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url = f"http://127.0.0.1:{int(child.stdout.readline())}"
        results["shm"] = {}
        for mb in (float(x) for x in args.buckets_mb.split(",")):
            with shm_sender(WeightTransportContext(role="sender"), bucket_bytes=int(mb * (1 << 20))) as sender:
                sender.send(weights, 0, [url])  # warm-up: the engine allocates, blocks are created
                t = best_time(lambda: sender.send(weights, 1, [url]), args.repeats)
            results["shm"][f"{mb:g}MiB"] = {"seconds": t, "gb_per_s": nbytes / t / 1e9, "ratio_vs_copy": copy_s / t}
        results["broadcast"] = {}
        for mb in (float(x) for x in args.buckets_mb.split(",")):
            with broadcast_sender(WeightTransportContext(role="sender"), bucket_bytes=int(mb * (1 << 20)),
                                  backend="gloo", group_name=f"bench_{mb:g}") as group_sender:
                group_sender.send(weights, 0, [url])  # warm-up: the group is set up, the engine allocates
                t = best_time(lambda: group_sender.send(weights, 1, [url]), args.repeats)  # noqa: B023
            results["broadcast"][f"{mb:g}MiB"] = {"seconds": t, "gb_per_s": nbytes / t / 1e9,
                                                  "ratio_vs_copy": copy_s / t}
        from loongsage_plugin_sglang.transport_tensor import TensorHandleSender

        results["handles"] = {}
        for mb in (float(x) for x in args.buckets_mb.split(",")):
            handles = TensorHandleSender(bucket_bytes=int(mb * (1 << 20)))
            handles.send(weights, 0, [url])  # warm-up: staging buffers are allocated and shared
            t = best_time(lambda: handles.send(weights, 1, [url]), args.repeats)  # noqa: B023
            handles.close()
            results["handles"][f"{mb:g}MiB"] = {"seconds": t, "gb_per_s": nbytes / t / 1e9,
                                                "ratio_vs_copy": copy_s / t}
        httpx.get(url + "/shutdown", trust_env=False)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
