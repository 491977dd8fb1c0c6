"""The per-step optimizer settings a caller driving steps in parts may give
(``StepwiseTraining.optimizer_step(hyperparameters=...)``, e.g. the Tinker service's ``AdamParams``),
applied the same way by every train backend."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

STEP_HYPERPARAMETERS = ("lr", "beta1", "beta2", "eps", "weight_decay", "grad_clip")
"""What a step may set: Adam's learning rate, betas, eps and (decoupled) weight decay, and the
gradient-norm clip of that step."""


def apply_step_hyperparameters(param_groups: Iterable[dict[str, Any]], hyperparameters: Mapping[str, float] | None,
                               *, where: str) -> dict[str, float]:
    """Set ``lr``, ``beta1`` / ``beta2``, ``eps`` and ``weight_decay`` of ``hyperparameters`` on
    every Adam parameter group (they stay for later steps); returns them all as floats, so the
    caller reads ``grad_clip`` (that step's only). An unknown key is a ``ValueError`` naming
    ``where`` and the keys accepted."""
    given = {key: float(value) for key, value in (hyperparameters or {}).items()}
    unknown = sorted(set(given) - set(STEP_HYPERPARAMETERS))
    if unknown:
        raise ValueError(f"{where}: unknown hyperparameters {', '.join(unknown)} "
                         f"(accepted: {', '.join(STEP_HYPERPARAMETERS)})")
    for group in param_groups:
        if "lr" in given:
            group["lr"] = given["lr"]
        beta1, beta2 = group["betas"]
        group["betas"] = (given.get("beta1", beta1), given.get("beta2", beta2))
        for key in ("eps", "weight_decay"):
            if key in given:
                group[key] = given[key]
    return given
