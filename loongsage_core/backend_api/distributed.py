"""Rendezvous of ``torch.distributed`` groups across processes (Gloo groups kept on the node's
address with :func:`pin_gloo_to_this_node`), and weight-update groups between trainers and engines."""

from __future__ import annotations

from ..rendezvous import free_port, host_rendezvous, pin_gloo_to_this_node, reachable_address, retry_on_port_collision
from ..weight_group import (
    destroy_weight_update_group,
    init_weight_update_group,
    join_with_engines,
    node_id,
    resolve_backend,
)

__all__ = ["destroy_weight_update_group", "free_port", "host_rendezvous", "init_weight_update_group",
           "join_with_engines", "node_id", "pin_gloo_to_this_node", "reachable_address", "resolve_backend",
           "retry_on_port_collision"]
