"""A stand-in for an SGLang server's control endpoints, for tests on machines without SGLang.

It is a real HTTP server (``http.server``) that records every request (method, path, JSON body)
and answers like SGLang does (``{"success": true, "message": ...}``). Behaviour beyond recording:

* ``/update_weights_from_disk`` opens the safetensors files of ``model_path`` and records each
  tensor's name, dtype, shape and sum, so a test checks what a sender wrote;
* with ``join_groups`` (subprocess mode, ``python standin_sglang.py PORTFILE``),
  ``/init_weights_update_group`` joins the trainer's process group (gloo, CPU) at ``rank_offset``
  and ``/update_weights_from_distributed`` receives the announced tensors by broadcast from rank 0
  and records them the same way;
* ``/load_lora_adapter`` reads the PEFT adapter directory ``lora_path`` (``adapter_config.json``,
  ``adapter_model.safetensors``) and records its tensors and config under ``lora_name``; like
  SGLang it refuses a name that is already loaded; ``/unload_lora_adapter`` forgets one (an
  unknown name is refused); ``/update_weight_version`` sets the version (``new_version``);
  ``/generate`` answers 400 when its ``lora_path`` names no loaded adapter;
* ``GET /_recorded`` returns the log; ``GET /get_weight_version`` answers 404 (as newer SGLang
  releases do) and ``GET /model_info`` carries the weight version.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def tensor_record(name: str, t: Any) -> dict[str, Any]:
    return {"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "sum": float(t.double().sum())}


class StandIn:
    def __init__(self, join_groups: bool = False) -> None:
        self.requests: list[dict[str, Any]] = []
        self.loaded: list[dict[str, Any]] = []
        self.weight_version = "0"
        self.adapters: dict[str, dict[str, Any]] = {}
        self.join_groups = join_groups
        self.groups: dict[str, Any] = {}
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                outer.handle(self, "GET", None)

            def do_POST(self) -> None:  # noqa: N802
                n = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(n) if n else b""
                outer.handle(self, "POST", json.loads(raw) if raw else None)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> "StandIn":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def handle(self, h: Any, method: str, body: Any) -> None:
        path = h.path.split("?")[0]
        if path == "/_recorded":
            return h._reply(200, {"requests": self.requests, "loaded": self.loaded, "adapters": self.adapters})
        with self.lock:
            self.requests.append({"method": method, "path": path, "body": body})
        if path in ("/get_weight_version", "/weight_version"):
            return h._reply(404, {"detail": "moved to /model_info"})
        if path == "/model_info":
            return h._reply(200, {"model_path": "m", "weight_version": self.weight_version})
        if path == "/health":
            return h._reply(200, {})
        if path == "/update_weights_from_disk":
            return self.load_disk(h, body)
        if path == "/init_weights_update_group" and self.join_groups:
            return self.join(h, body)
        if path == "/update_weights_from_distributed" and self.join_groups:
            return self.receive(h, body)
        if path == "/load_lora_adapter":
            return self.load_adapter(h, body)
        if path == "/unload_lora_adapter":
            if body["lora_name"] not in self.adapters:
                return h._reply(400, {"success": False, "error_message": f"LoRA adapter {body['lora_name']} not found"})
            del self.adapters[body["lora_name"]]
            return h._reply(200, {"success": True, "loaded_adapters": sorted(self.adapters)})
        if path == "/update_weight_version":
            self.weight_version = body["new_version"]
            return h._reply(200, {"success": True, "message": "ok"})
        if path == "/generate":
            name = (body or {}).get("lora_path")
            if name is not None and name not in self.adapters:
                return h._reply(400, {"error": {"message": f"LoRA adapter {name!r} is not loaded"}})
            return h._reply(200, {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "length"}}})
        if path == "/fail":
            return h._reply(400, {"success": False, "message": "bad things"})
        if body and body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return h._reply(200, {"success": True, "message": "ok"})

    def load_disk(self, h: Any, body: dict[str, Any]) -> None:
        from safetensors.torch import load_file

        files = sorted(Path(body["model_path"]).glob("*.safetensors"))
        if not files:
            return h._reply(400, {"success": False, "message": f"no safetensors in {body['model_path']}"})
        for f in files:
            for name, t in load_file(str(f)).items():
                self.loaded.append({**tensor_record(name, t), "file": f.name, "version": body.get("weight_version")})
        self.weight_version = body.get("weight_version", self.weight_version)
        return h._reply(200, {"success": True, "message": "loaded", "num_paused_requests": 0})

    def load_adapter(self, h: Any, body: dict[str, Any]) -> None:
        from safetensors.torch import load_file

        name, where = body["lora_name"], Path(body["lora_path"])
        if name in self.adapters:
            return h._reply(400, {"success": False, "error_message": f"LoRA adapter {name} is already loaded"})
        try:
            config = json.loads((where / "adapter_config.json").read_text())
            tensors = load_file(str(where / "adapter_model.safetensors"))
        except (OSError, ValueError) as exc:
            return h._reply(400, {"success": False, "error_message": f"cannot load {where}: {exc}"})
        self.adapters[name] = {"path": str(where), "config": config,
                               "tensors": [tensor_record(n, t) for n, t in sorted(tensors.items())]}
        return h._reply(200, {"success": True, "loaded_adapters": sorted(self.adapters)})

    def join(self, h: Any, body: dict[str, Any]) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from loongsage_core.weight_group import init_weight_update_group

        group = init_weight_update_group(body["master_address"], body["master_port"], body["rank_offset"],
                                         body["world_size"], group_name=body["group_name"], backend=body["backend"],
                                         timeout_s=60)
        self.groups[body["group_name"]] = group
        return h._reply(200, {"success": True, "message": "joined"})

    def receive(self, h: Any, body: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        group = self.groups[body["group_name"]]
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(t, src=0, group=group)
            self.loaded.append({**tensor_record(name, t), "version": body.get("weight_version")})
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return h._reply(200, {"success": True, "message": "received"})


def main() -> None:
    server = StandIn(join_groups=True)
    Path(sys.argv[1]).write_text(server.url)
    server.server.serve_forever()


if __name__ == "__main__":
    main()
