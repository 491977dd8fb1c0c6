"""Random-number-generator state capture and restore, in a form ``torch.load(weights_only=True)`` reads."""

from __future__ import annotations

import random
from typing import Any


def capture_rng() -> dict[str, Any]:
    """The states of torch (CPU and CUDA), Python ``random`` and NumPy's global generator."""
    import torch

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch installs
        return state
    legacy: Any = np.random.get_state(legacy=True)
    kind, keys, pos, has_gauss, cached = legacy
    state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set every generator captured by :func:`capture_rng` back to its saved state."""
    import torch

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"],
                             s["cached_gaussian"]))


def seed_everything(seed: int) -> None:
    """Seed torch, Python ``random`` and NumPy from one integer."""
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:  # pragma: no cover
        pass
