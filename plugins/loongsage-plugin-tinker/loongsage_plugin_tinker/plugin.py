"""Hook implementations of the tinker plugin: the Tinker losses as loss components (:mod:`.losses`).

The service itself is the ``loongsage tinker-serve`` command (:mod:`.cli`), registered through the
``loongsage.commands`` entry-point group.
"""

from __future__ import annotations

from typing import Any, Iterable

from loongsage_hookspecs import hookimpl

from .losses import SPECS


@hookimpl
def loongsage_policy_losses() -> Iterable[Any]:
    return [spec for spec in SPECS if type(spec).__name__ == "PolicyLossSpec"]


@hookimpl
def loongsage_loss_aggregations() -> Iterable[Any]:
    return [spec for spec in SPECS if type(spec).__name__ == "AggregationSpec"]
