"""Argument and tensor validation shared by every component of this plugin.

Components receive keyword arguments straight from a job file's ``*_args`` tables, so a typo or
a wrong type must fail with a message that names the component, the argument and the bad value.
This module imports no torch at import time; tensor checks import it lazily.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]`` before ``exp`` so a stale or
broken log-prob can never produce ``inf`` (``exp(20) ~ 4.9e8``)."""


def number(owner: str, name: str, value: Any, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a finite float within the given bounds, else a ``ValueError``/``TypeError``.

    ``low_open`` / ``high_open`` make the bound strict. Booleans are rejected (TOML ``true`` is not
    a number here).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}: argument {name!r} must be a number, got {value!r} ({type(value).__name__})")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{owner}: argument {name!r} must be finite, got {value!r}")
    if low is not None and (x < low or (low_open and x == low)):
        op = ">" if low_open else ">="
        raise ValueError(f"{owner}: argument {name!r} must be {op} {low}, got {value!r}")
    if high is not None and (x > high or (high_open and x == high)):
        op = "<" if high_open else "<="
        raise ValueError(f"{owner}: argument {name!r} must be {op} {high}, got {value!r}")
    return x


def optional_number(owner: str, name: str, value: Any, **bounds: Any) -> float | None:
    """Like :func:`number` but ``None`` passes through (an unset optional argument)."""
    return None if value is None else number(owner, name, value, **bounds)


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


def tensor2d(owner: str, name: str, value: Any, like: "torch.Tensor | None" = None) -> "torch.Tensor":
    """``value`` if it is a 2-D tensor (of ``like``'s shape when given), else a clear error."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor [B, T], got {type(value).__name__}")
    if value.dim() != 2:
        raise ValueError(f"{owner}: {name} must be 2-D [B, T], got shape {tuple(value.shape)}")
    if like is not None and value.shape != like.shape:
        raise ValueError(f"{owner}: {name} has shape {tuple(value.shape)} but the response mask has "
                         f"shape {tuple(like.shape)}; all per-token tensors must be [B, T] and aligned")
    return value


def float_tensor2d(owner: str, name: str, value: Any, like: "torch.Tensor | None" = None) -> "torch.Tensor":
    """Like :func:`tensor2d` and also a floating-point dtype (log-probs, advantages, losses)."""
    t = tensor2d(owner, name, value, like)
    if not t.is_floating_point():
        raise TypeError(f"{owner}: {name} must be a floating-point tensor, got dtype {t.dtype}")
    return t


def tensor1d(owner: str, name: str, value: Any, rows: int) -> "torch.Tensor":
    """``value`` if it is a 1-D tensor of ``rows`` entries, else a clear error."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor [B], got {type(value).__name__}")
    if value.dim() != 1 or value.shape[0] != rows:
        raise ValueError(f"{owner}: {name} must have shape [{rows}] (one entry per row of the response "
                         f"mask), got shape {tuple(value.shape)}")
    return value


def mask_bool(owner: str, mask: Any, name: str = "response_mask") -> "torch.Tensor":
    """The 2-D mask as a bool tensor (nonzero entries are trained tokens)."""
    return tensor2d(owner, name, mask) != 0
