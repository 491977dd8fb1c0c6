"""Argument and tensor validation shared by the distillation components.

Components receive keyword arguments straight from a job file's ``*_args`` tables and tensors from
the host, so a typo, a wrong type or a misaligned tensor must fail with a message that names the
component, the argument and the bad value. No torch import at module import time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

LOG_RATIO_CLAMP = 20.0
"""Default bound on ``ref - logp`` before ``exp`` in k3 (``exp(20) ~ 4.9e8``), so one token whose
teacher probability collapsed cannot produce ``inf``."""


def number(owner: str, name: str, value: Any, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a finite float within the given bounds, else a ``TypeError``/``ValueError``.

    Booleans are rejected (a TOML ``true`` is not a number here).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}: argument {name!r} must be a number, got {value!r} ({type(value).__name__})")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{owner}: argument {name!r} must be finite, got {value!r}")
    if low is not None and (x < low or (low_open and x == low)):
        raise ValueError(f"{owner}: argument {name!r} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and (x > high or (high_open and x == high)):
        raise ValueError(f"{owner}: argument {name!r} must be {'<' if high_open else '<='} {high}, got {value!r}")
    return x


def optional_number(owner: str, name: str, value: Any, **bounds: Any) -> float | None:
    """Like :func:`number`, but ``None`` (an unset optional argument) passes through."""
    return None if value is None else number(owner, name, value, **bounds)


def integer(owner: str, name: str, value: Any, *, low: int | None = None) -> int:
    """``value`` if it is an int (not a bool) of at least ``low``, else a clear error."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: argument {name!r} must be an integer, got {value!r} ({type(value).__name__})")
    if low is not None and value < low:
        raise ValueError(f"{owner}: argument {name!r} must be >= {low}, got {value!r}")
    return value


def flag(owner: str, name: str, value: Any) -> bool:
    """``value`` if it is a bool, else a ``TypeError`` (``1`` or ``"yes"`` are not accepted)."""
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: argument {name!r} must be true or false, got {value!r}")
    return value


def choice(owner: str, name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``, else a ``ValueError`` listing them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{owner}: argument {name!r} must be one of {list(choices)}, got {value!r}")
    return value


def mask_bool(owner: str, mask: Any) -> "torch.Tensor":
    """The 2-D response mask as a bool tensor (nonzero entries are trained tokens)."""
    import torch

    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{owner}: response_mask must be a torch.Tensor [B, T], got {type(mask).__name__}")
    if mask.dim() != 2:
        raise ValueError(f"{owner}: response_mask must be 2-D [B, T], got shape {tuple(mask.shape)}")
    return mask != 0


def token_tensor(owner: str, name: str, value: Any, mask: "torch.Tensor") -> "torch.Tensor":
    """``value`` if it is a floating-point ``[B, T]`` tensor of the mask's shape, else a clear error."""
    import torch

    if value is None:
        raise ValueError(f"{owner}: KLInputs.{name} is not set; this component needs it")
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor [B, T], got {type(value).__name__}")
    if tuple(value.shape) != tuple(mask.shape):
        raise ValueError(f"{owner}: {name} has shape {tuple(value.shape)} but the response mask has shape "
                         f"{tuple(mask.shape)}; per-token tensors must be [B, T] and aligned")
    if not value.is_floating_point():
        raise TypeError(f"{owner}: {name} must be a floating-point tensor, got dtype {value.dtype}")
    return value


def vocab_tensor(owner: str, name: str, value: Any, mask: "torch.Tensor", *, floating: bool = True,
                 ) -> "torch.Tensor":
    """``value`` as a ``[B, T, X]`` tensor aligned with the tokens.

    Accepts the aligned layout ``[B, T, X]`` (entry ``t`` describes the distribution that produced
    token ``t``) and the next-token layout ``[B, T - 1, X]`` a causal LM's forward pass yields
    (entry ``t`` scores token ``t + 1``); the latter is shifted right by one, position 0 (which
    has no prediction and is never trained) becoming zeros.
    """
    import torch

    if value is None:
        raise ValueError(f"{owner}: KLInputs.{name} is not set; this component needs it")
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor [B, T, X], got {type(value).__name__}")
    rows, width = mask.shape
    if value.dim() != 3 or value.shape[0] != rows or value.shape[1] not in (width, width - 1):
        raise ValueError(f"{owner}: {name} must have shape [{rows}, {width}, X] (aligned with the tokens) or "
                         f"[{rows}, {width - 1}, X] (next-token layout), got {tuple(value.shape)}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{owner}: {name} must be a floating-point tensor, got dtype {value.dtype}")
    if value.shape[1] == width - 1:
        value = torch.nn.functional.pad(value, (0, 0, 1, 0))
    return value


def compute_dtype(t: "torch.Tensor") -> "torch.dtype":
    """The dtype the math runs in: float64 stays float64, everything else becomes float32."""
    import torch

    return torch.float64 if t.dtype == torch.float64 else torch.float32
