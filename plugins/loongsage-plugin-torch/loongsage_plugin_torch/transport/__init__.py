"""Weight transports of the torch plugin: trainer weights into rollout engines.

* ``inprocess``: the engine objects live in the trainer's process; their ``load_weights`` is
  called with the trainer's tensors directly.
* ``shm``: tensors are packed into shared-memory buckets on one node and each bucket's metadata
  is POSTed to every engine's ``/update_weights_from_tensor`` (``load_format = "shm"``); the
  engine's receiver maps the bucket and yields the tensors.
* ``broadcast``: a torch.distributed group (Gloo on CPU, NCCL on CUDA) set up once between the
  trainer (rank 0) and the engines; each bucket's metadata is POSTed to
  ``/update_weights_from_distributed``, then its bytes are broadcast. For engines on other
  devices or nodes.
* ``auto``: per engine, the fastest of the above (engine object: ``inprocess``; same node, CPU:
  ``shm``; otherwise ``broadcast``), decided once from the engine's ``/get_server_info``.

The factories below (``sender(ctx, **args)`` / ``receiver(ctx, **args)``, ``ctx`` a
:class:`~loongsage_hookspecs.WeightTransportContext` these transports need nothing from) import
torch only when called, so the plugin module stays light.
"""

from __future__ import annotations

from typing import Any

from loongsage_hookspecs import WeightTransportContext


def inprocess_sender(ctx: WeightTransportContext, **args: Any) -> Any:
    """``WeightSender`` calling ``target.load_weights(named_tensors, version)`` on in-process engines."""
    from .inprocess import InProcessSender

    return InProcessSender(**args)


def inprocess_receiver(ctx: WeightTransportContext, **args: Any) -> Any:
    """``WeightReceiver`` yielding the ``named_tensors`` list an in-process payload carries."""
    from .inprocess import InProcessReceiver

    return InProcessReceiver(**args)


def shm_sender(ctx: WeightTransportContext, **args: Any) -> Any:
    """``WeightSender`` packing tensors into shared-memory buckets announced over HTTP."""
    from .shm import ShmSender

    return ShmSender(**args)


def shm_receiver(ctx: WeightTransportContext, **args: Any) -> Any:
    """``WeightReceiver`` mapping the shared-memory bucket a payload names."""
    from .shm import ShmReceiver

    return ShmReceiver(**args)


def broadcast_sender(ctx: WeightTransportContext, **args: Any) -> Any:
    """``WeightSender`` broadcasting flat byte buckets over a weight-update process group."""
    from .broadcast import BroadcastSender

    return BroadcastSender(**args)


def broadcast_receiver(ctx: WeightTransportContext, **args: Any) -> Any:
    """``WeightReceiver`` joining weight-update groups and receiving their broadcasts."""
    from .broadcast import BroadcastReceiver

    return BroadcastReceiver(**args)


def auto_sender(ctx: WeightTransportContext, **args: Any) -> Any:
    """``WeightSender`` choosing inprocess, shm or broadcast per engine."""
    from .auto import AutoSender

    return AutoSender(**args)


__all__ = ["auto_sender", "broadcast_receiver", "broadcast_sender", "inprocess_receiver", "inprocess_sender",
           "shm_receiver", "shm_sender"]
