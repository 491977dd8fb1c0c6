"""LoRA adapters into SGLang servers, for every SGLang weight transport of a LoRA run.

With ``[train] lora`` the trainer sends only the adapter (named as PEFT saves it, see
:mod:`loongsage_hookspecs.lora`). SGLang takes adapters by name, not through its weight-update
endpoints: each version is written as a PEFT adapter directory (``adapter_model.safetensors`` +
``adapter_config.json``) and every server is asked to swap it in:
``POST /unload_lora_adapter {"lora_name": "policy"}`` (from the second version on),
``POST /load_lora_adapter {"lora_name": "policy", "lora_path": DIR}``, then
``POST /update_weight_version {"new_version": "v"}``. Generation requests of the run name the
adapter with ``lora_path = "policy"`` (the host's engine client adds it); the servers are
launched with ``--enable-lora`` (:mod:`.launch`).

``sglang_disk``, ``sglang_nccl`` and ``sglang_tensor`` all carry an adapter this way (their
``configure_lora`` switches them over): an adapter is small, so the disk is not the bottleneck,
and one path means one behaviour to test. The servers must read ``directory`` at the same path
(one node or a shared filesystem). Adapters are swapped while the engines are paused (the
controller's weight-update phase); between the unload and the load, a request naming the adapter
would be refused.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from loongsage_hookspecs import LORA_ADAPTER_NAME, LORA_TENSOR_SUFFIXES, LoraSettings, is_lora_tensor

from .client import SGLangClient
from .targets import target_url

if TYPE_CHECKING:  # pragma: no cover
    import torch


def adapter_config(settings: LoraSettings, modules: Iterable[str]) -> dict[str, Any]:
    """The ``adapter_config.json`` of an adapter with ``settings`` on the modules ``modules``
    (their last name part: ``q_proj``, ...), as PEFT writes it for a causal LM."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(settings.rank),
            "lora_alpha": float(settings.alpha), "lora_dropout": float(settings.dropout),
            "target_modules": sorted(set(modules)), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "base_model_name_or_path": None}


def write_adapter(weights: Iterable[tuple[str, "torch.Tensor"]], settings: LoraSettings, out_dir: Path) -> int:
    """Write the adapter tensors ``weights`` as a PEFT adapter directory; returns its bytes.

    Anything but adapter tensors in ``weights`` is an error: SGLang loads adapters, not weights.
    """
    from safetensors.torch import save_file

    tensors: dict[str, Any] = {}
    modules: set[str] = set()
    for name, tensor in weights:
        if not is_lora_tensor(name):
            raise ValueError(f"LoRA weight sync to SGLang: '{name}' is not a LoRA adapter tensor (a LoRA run "
                             "sends its adapter alone)")
        if name in tensors:
            raise ValueError(f"LoRA weight sync to SGLang: tensor {name!r} appears twice")
        tensors[name] = tensor.detach().to("cpu").contiguous().clone()
        module = name[: -len(next(s for s in LORA_TENSOR_SUFFIXES if name.endswith(s)))]
        modules.add(module.rsplit(".", 1)[-1])
    if not tensors:
        raise ValueError("LoRA weight sync to SGLang: the trainer sent no adapter tensors")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config(settings, modules), indent=1))
    return sum(t.numel() * t.element_size() for t in tensors.values())


class AdapterLoader:
    """Writes each adapter version and swaps it into SGLang servers (see the module docstring).

    ``directory``: where version directories go (default: a fresh temporary directory);
    ``keep``: version directories kept on disk; ``timeout_s``: per-request HTTP timeout.
    """

    def __init__(self, settings: LoraSettings, directory: str | None = None, keep: int = 1,
                 timeout_s: float | None = None) -> None:
        self.settings = settings
        self._own_dir = directory is None
        self.directory = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="loongsage-lora-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = max(1, int(keep))
        self.timeout_s = timeout_s
        self._loaded: set[str] = set()  # servers holding the adapter (the next version unloads it first)
        self._written: list[Path] = []

    def send(self, weights: Iterable[tuple[str, "torch.Tensor"]], version: int, urls: list[str]) -> dict[str, float]:
        start = time.perf_counter()
        path = self.directory / f"adapter_v{int(version)}"
        staging = path.with_name(path.name + ".partial")
        for stale in (path, staging):
            if stale.exists():
                shutil.rmtree(stale)
        nbytes = write_adapter(weights, self.settings, staging)
        staging.rename(path)
        written = time.perf_counter()

        def swap(url: str) -> None:
            with SGLangClient(url, timeout=self.timeout_s) as client:
                if url in self._loaded:
                    client.unload_lora_adapter(LORA_ADAPTER_NAME)
                    self._loaded.discard(url)
                client.load_lora_adapter(LORA_ADAPTER_NAME, str(path))
                self._loaded.add(url)
                client.update_weight_version(version)

        if urls:
            with ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="sglang-lora") as pool:
                for fut in [pool.submit(swap, u) for u in urls]:
                    fut.result()
        done = time.perf_counter()
        self._written.append(path)
        while len(self._written) > self.keep:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)
        return {"perf/weight_update_bytes": float(nbytes), "timing/weight_update_s": done - start,
                "timing/weight_write_s": written - start, "timing/weight_reload_s": done - written}

    def close(self) -> None:
        for path in self._written:
            shutil.rmtree(path, ignore_errors=True)
        self._written = []
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)


class LoraSwitch:
    """Mixed into the SGLang senders: after :meth:`configure_lora` (the host calls it once in a LoRA
    run, before the first send) ``send`` goes through an :class:`AdapterLoader` instead."""

    _lora: AdapterLoader | None = None
    timeout_s: float | None = None

    def configure_lora(self, settings: LoraSettings) -> None:
        """Send the run's LoRA adapter through SGLang's adapter endpoints from now on."""
        if self._lora is None:
            self._lora = AdapterLoader(settings, timeout_s=self.timeout_s)

    def _send_adapter(self, weights: Iterable[tuple[str, "torch.Tensor"]], version: int, targets: list[Any],
                      transport: str) -> dict[str, float]:
        assert self._lora is not None
        return self._lora.send(weights, version, [target_url(t, transport) for t in targets])

    def _close_adapter(self) -> None:
        if self._lora is not None:
            self._lora.close()
            self._lora = None
