"""The ``sglang_disk`` weight transport: safetensors on a shared filesystem, reloaded by SGLang.

The sender (trainer process) writes the weights of version ``v`` as a Hugging Face safetensors
checkpoint into ``<directory>/v<v>/`` (``model.safetensors``, or shards of at most ``shard_bytes``
with ``model.safetensors.index.json``), copies the non-weight files of ``config_from`` (the model
directory: ``config.json``, tokenizer files, ...) beside them, and asks every engine to reload with
``POST /update_weights_from_disk {"model_path": ..., "load_format": ..., "weight_version": "v"}``.
Older version directories are deleted once every engine holds the new one (``keep`` newest are
kept). The engines must see ``directory`` at the same path (one node, or a shared filesystem).

Slow but simple and robust: it works with any SGLang parallelism, and the checkpoint on disk is
a usable Hugging Face model.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from .client import SGLangClient
from .targets import target_url
from .transport_lora import LoraSwitch

if TYPE_CHECKING:  # pragma: no cover
    import torch

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def write_safetensors(weights: Iterable[tuple[str, "torch.Tensor"]], out_dir: str | Path,
                      shard_bytes: int = 4 << 30) -> dict[str, Any]:
    """Write ``weights`` as a (possibly sharded) Hugging Face safetensors checkpoint in ``out_dir``.

    Each tensor is copied to a contiguous CPU tensor, so tied or overlapping storages are saved as
    separate entries. Returns ``{"bytes", "tensors", "files"}``.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    size = 0
    total = 0
    count = 0
    seen: set[str] = set()
    for name, tensor in weights:
        if name in seen:
            raise ValueError(f"sglang_disk weight transport: tensor {name!r} appears twice in the weights")
        seen.add(name)
        t = tensor.detach().to("cpu").contiguous().clone()
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
        total += nbytes
        count += 1
    if current or not shards:
        shards.append(current)
    files: list[str] = []
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({k: fname for k in shard})
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1, sort_keys=True))
    return {"bytes": total, "tensors": count, "files": files}


def copy_model_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the non-weight files of a model directory (config, tokenizer, ...) into ``dst``."""
    src, dst = Path(src), Path(dst)
    copied = []
    for item in sorted(src.iterdir()):
        if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES) and not item.name.endswith(".index.json"):
            shutil.copy2(item, dst / item.name)
            copied.append(item.name)
    return copied


class DiskSender(LoraSwitch):
    """Trainer side of ``sglang_disk`` (a ``WeightSender``).

    ``directory``: where version directories are written (default: a fresh temporary directory);
    ``config_from``: a model directory whose config and tokenizer files go beside the weights;
    ``load_format``: SGLang's ``load_format`` for the reload (``None``: SGLang's default);
    ``shard_bytes``: largest safetensors file; ``keep``: version directories kept on disk;
    ``timeout_s``: per-request HTTP timeout (``None`` waits as long as the reload takes).
    """

    def __init__(self, directory: str | None = None, config_from: str | None = None, load_format: str | None = None,
                 shard_bytes: int = 4 << 30, keep: int = 1, timeout_s: float | None = None,
                 flush_cache: bool = True, abort_all_requests: bool = False, delta: bool = False) -> None:
        if delta:
            raise ValueError("sglang_disk weight transport: weight_transport_args.delta = true is not supported: an "
                             "SGLang server reloads whole safetensors files; delta sync is offered by the torch "
                             "plugin's shm and broadcast transports")
        if int(shard_bytes) < 1:
            raise ValueError(f"sglang_disk weight transport: shard_bytes must be positive, got {shard_bytes}")
        if int(keep) < 1:
            raise ValueError(f"sglang_disk weight transport: keep must be >= 1, got {keep}")
        if config_from is not None and not Path(config_from).is_dir():
            raise ValueError(f"sglang_disk weight transport: config_from {config_from!r} is not a directory")
        self._own_dir = directory is None
        self.directory = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="loongsage-weights-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config_from = config_from
        self.load_format = load_format
        self.shard_bytes = int(shard_bytes)
        self.keep = int(keep)
        self.timeout_s = timeout_s
        self.flush_cache = bool(flush_cache)
        self.abort_all_requests = bool(abort_all_requests)
        self._written: list[Path] = []

    def version_dir(self, version: int) -> Path:
        return self.directory / f"v{int(version)}"

    def send(self, weights: Iterable[tuple[str, "torch.Tensor"]], version: int, targets: list[Any]) -> dict[str, float]:
        """Write version ``version`` and have every target reload it; returns timing metrics."""
        if self._lora is not None:  # a LoRA run: the adapter goes through SGLang's adapter endpoints
            return self._send_adapter(weights, version, targets, "sglang_disk")
        urls = [target_url(t, "sglang_disk") for t in targets]
        start = time.perf_counter()
        path = self.version_dir(version)
        if path.exists():
            shutil.rmtree(path)
        staging = path.with_name(path.name + ".partial")
        if staging.exists():
            shutil.rmtree(staging)
        info = write_safetensors(weights, staging, self.shard_bytes)
        if self.config_from:
            copy_model_files(self.config_from, staging)
        staging.rename(path)
        written = time.perf_counter()

        def reload(url: str) -> None:
            with SGLangClient(url, timeout=self.timeout_s) as client:
                client.update_weights_from_disk(str(path), load_format=self.load_format, weight_version=version,
                                                flush_cache=self.flush_cache,
                                                abort_all_requests=self.abort_all_requests)

        if urls:
            with ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="sglang-disk") as pool:
                for fut in [pool.submit(reload, u) for u in urls]:
                    fut.result()
        done = time.perf_counter()
        self._written.append(path)
        while len(self._written) > self.keep:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)
        return {"perf/weight_update_bytes": float(info["bytes"]), "timing/weight_update_s": done - start,
                "timing/weight_write_s": written - start, "timing/weight_reload_s": done - written}

    def close(self) -> None:
        """Delete the version directories this sender wrote (and its own temporary directory)."""
        self._close_adapter()
        for path in self._written:
            shutil.rmtree(path, ignore_errors=True)
        self._written = []
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)
