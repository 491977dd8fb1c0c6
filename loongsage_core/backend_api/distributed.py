"""Rendezvous of ``torch.distributed`` groups across processes, and weight-update groups between
trainers and engines."""

from __future__ import annotations

from ..rendezvous import free_port, host_rendezvous, reachable_address, retry_on_port_collision
from ..weight_group import (
    destroy_weight_update_group,
    init_weight_update_group,
    join_with_engines,
    node_id,
    resolve_backend,
)

__all__ = ["destroy_weight_update_group", "free_port", "host_rendezvous", "init_weight_update_group",
           "join_with_engines", "node_id", "reachable_address", "resolve_backend", "retry_on_port_collision"]
