"""Weight updates of the embedded engine: decoding the ``direct`` format and copying in place.

``direct`` is the engine's own ``load_format`` (also what an unset ``load_format`` means):
``serialized_named_tensors`` is base64 text (or a list of them, one per sender rank, as SGLang
sends one entry per tensor-parallel rank) of either

* ``torch.save`` of a list of ``(name, tensor)`` pairs: the bytes themselves; or
* SGLang's ``MultiprocessingSerializer`` form, a ``torch.multiprocessing`` pickle of that list:
  *handles* to tensors in shared memory (or CUDA IPC handles), which the engine opens and copies
  from (the sglang plugin's ``sglang_tensor`` transport). Only the globals a tensor handle needs
  are unpickled; anything else in the payload is refused, so a request cannot run code.

Any other ``load_format`` names a weight transport component whose receiver turns the request
into ``(name, tensor)`` pairs.
"""

from __future__ import annotations

import base64
import io
import pickle
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

if TYPE_CHECKING:  # pragma: no cover
    import torch

DIRECT_FORMAT = "direct"
SHM_MANAGER_TIMEOUT = "Shared memory manager connection has timed out"
"""Opening a shared-memory handle registers it with the sender's ``torch_shm_manager``, which
must answer within one second; on a loaded machine it may not, so the open is retried."""
SHM_MANAGER_ATTEMPTS = 5


class WeightUpdateError(ValueError):
    """A weight update names an unknown parameter, has a wrong shape, or cannot be decoded."""


HANDLE_GLOBALS = {
    "torch.multiprocessing.reductions": {"rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage",
                                         "rebuild_typed_storage_child", "rebuild_storage_filename",
                                         "rebuild_storage_empty", "rebuild_parameter"},
    "torch.storage": {"UntypedStorage", "TypedStorage"},
    "torch": {"Tensor", "Size", "UntypedStorage"},
    "torch.nn.parameter": {"Parameter"},
}
"""What a ``torch.multiprocessing`` pickle of tensors may reference (plus ``torch.<dtype>``)."""


class _HandleUnpickler(pickle.Unpickler):
    """Unpickles tensor handles only: every global outside :data:`HANDLE_GLOBALS` is refused."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in HANDLE_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        hint = (" (file-descriptor sharing only reaches child processes: the sender must share CPU tensors "
                "with the 'file_system' strategy)" if name == "rebuild_storage_fd" else "")
        raise WeightUpdateError(f"'serialized_named_tensors' references {module}.{name}; only torch tensor "
                                f"handles are accepted{hint}")


def _load(data: bytes) -> Any:
    """A ``torch.save`` archive (zip) or a ``torch.multiprocessing`` pickle of handles."""
    import torch

    if data[:2] == b"PK":
        return torch.load(io.BytesIO(data), weights_only=True)
    if data[:1] == b"\x80":
        for attempt in range(SHM_MANAGER_ATTEMPTS):
            try:
                return _HandleUnpickler(io.BytesIO(data)).load()
            except RuntimeError as exc:
                if SHM_MANAGER_TIMEOUT not in str(exc) or attempt + 1 == SHM_MANAGER_ATTEMPTS:
                    raise
                time.sleep(0.2 * (attempt + 1))
    raise ValueError("neither a torch.save archive nor a pickle of tensor handles")


def decode_direct(payload: Mapping[str, Any]) -> Iterator[tuple[str, "torch.Tensor"]]:
    """``(name, tensor)`` pairs of a ``direct``-format ``serialized_named_tensors`` field.

    With several entries (one per sender tensor-parallel rank, each holding the full weights, as
    SGLang sends them) the embedded engine, a single rank, reads the first.
    """
    import torch

    raw = payload.get("serialized_named_tensors")
    parts = raw if isinstance(raw, list) else [raw]
    for i, part in enumerate(parts[:1]):
        if not isinstance(part, str):
            raise WeightUpdateError(
                f"'serialized_named_tensors' must be base64 text (or a list of them) for load_format "
                f"'{DIRECT_FORMAT}', got {type(part).__name__}")
        try:
            obj = _load(base64.b64decode(part, validate=True))
        except WeightUpdateError:
            raise
        except Exception as exc:  # any decoding failure is a malformed request
            raise WeightUpdateError(f"'serialized_named_tensors'[{i}] cannot be decoded as base64 torch.save "
                                    f"data or tensor handles: {exc}") from None
        pairs = obj.items() if isinstance(obj, dict) else obj
        for pair in pairs:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)
                    and isinstance(pair[1], torch.Tensor)):
                raise WeightUpdateError("'serialized_named_tensors' must hold (name, tensor) pairs")
            yield pair[0], pair[1]


def copy_named_tensors(targets: Mapping[str, "torch.Tensor"],
                       named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> int:
    """Copy each ``(name, tensor)`` into ``targets[name]`` in place; returns how many were copied.

    Tensors are checked and copied one at a time, so a transport may reuse its buffer between
    pairs; a bad name or shape stops the update with an error naming it.
    """
    import torch

    count = 0
    with torch.no_grad():
        for name, tensor in named_tensors:
            target = targets.get(name)
            if target is None:
                raise WeightUpdateError(f"weight update: unknown parameter name '{name}'")
            if tuple(tensor.shape) != tuple(target.shape):
                raise WeightUpdateError(f"weight update: '{name}' has shape {tuple(tensor.shape)}, "
                                        f"the model expects {tuple(target.shape)}")
            target.copy_(tensor)
            count += 1
    return count


def safetensors_dir_tensors(path: str, targets: Mapping[str, "torch.Tensor"]) -> Iterator[tuple[str, "torch.Tensor"]]:
    """The ``(name, tensor)`` pairs of a Hugging Face directory's safetensors files, one tensor at
    a time (what ``/update_weights_from_disk`` copies into the model). Every name and shape is
    checked against ``targets`` (the model's tensors) from the files' headers before the first
    tensor is read, so a directory of another model changes nothing; it, and a directory without
    safetensors files, is a :class:`WeightUpdateError` naming what is wrong."""
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if not files:
        raise WeightUpdateError(f"update_weights_from_disk: {path!r} is not a directory of safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                target = targets.get(name)
                if target is None:
                    raise WeightUpdateError(f"update_weights_from_disk: {file.name} holds '{name}', which the "
                                            "served model has no parameter for")
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(target.shape):
                    raise WeightUpdateError(f"update_weights_from_disk: '{name}' in {file.name} has shape {shape}, "
                                            f"the served model's is {tuple(target.shape)}")
    return _read_tensors(files)


def _read_tensors(files: list[Any]) -> Iterator[tuple[str, "torch.Tensor"]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
