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
* ``auto``: per engine, the fastest transport of every active plugin that ranks it (``auto_rank``
  of each ``WeightTransportSpec``: engine object: ``inprocess``; same node, CPU: ``shm``;
  otherwise ``broadcast``; SGLang servers: the sglang plugin's), decided once from the engine's
  ``/get_server_info`` (:mod:`.auto`).

The factories below (``sender(ctx, **args)`` / ``receiver(ctx, **args)``, ``ctx`` a
:class:`~loongsage_hookspecs.WeightTransportContext` these transports need nothing from) import
torch only when called, so the plugin module stays light.
"""

from __future__ import annotations

from typing import Any

from loongsage_hookspecs import WeightTarget, WeightTransportContext

# ``auto_rank`` of this plugin's transports (higher wins; see :mod:`.auto` for the whole table)
INPROCESS_RANK = 100
SHM_RANK = 80
BROADCAST_RANK = 50


def inprocess_rank(target: WeightTarget) -> int | None:
    """An engine object in the trainer's process takes the trainer's tensors directly."""
    return INPROCESS_RANK if target.in_process else None


def shm_rank(target: WeightTarget) -> int | None:
    """Shared memory reaches an engine that maps this node's memory: same node id, weights on the
    CPU, and a receiver for ``shm`` (an engine started without the plugins has none)."""
    if target.in_process or "shm" not in target.load_formats or target.engine_on_gpu:
        return None
    return SHM_RANK if target.engine_node is not None and target.engine_node == target.trainer_node else None


def broadcast_rank(target: WeightTarget) -> int | None:
    """A torch.distributed group reaches any engine with a ``broadcast`` receiver: another node,
    or weights on an accelerator (NCCL)."""
    return BROADCAST_RANK if not target.in_process and "broadcast" in target.load_formats else None


def _engine_precision(sender: Any, ctx: WeightTransportContext) -> Any:
    """A delta sender encodes in the engine's precision (``[rollout] engine_args.dtype``)."""
    if getattr(sender, "delta", None) is not None:
        from .delta import engine_dtype

        sender.delta.engine_dtype = engine_dtype(ctx)
    return sender


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

    return _engine_precision(ShmSender(**args), ctx)


def shm_receiver(ctx: WeightTransportContext, **args: Any) -> Any:
    """``WeightReceiver`` mapping the shared-memory bucket a payload names."""
    from .shm import ShmReceiver

    return ShmReceiver(**args)


def broadcast_sender(ctx: WeightTransportContext, **args: Any) -> Any:
    """``WeightSender`` broadcasting flat byte buckets over a weight-update process group."""
    from .broadcast import BroadcastSender

    return _engine_precision(BroadcastSender(**args), ctx)


def broadcast_receiver(ctx: WeightTransportContext, **args: Any) -> Any:
    """``WeightReceiver`` joining weight-update groups and receiving their broadcasts."""
    from .broadcast import BroadcastReceiver

    return BroadcastReceiver(**args)


def auto_sender(ctx: WeightTransportContext, **args: Any) -> Any:
    """``WeightSender`` routing each engine to the transport that ranks it highest."""
    from .auto import AutoSender

    return AutoSender.from_context(ctx, **args)


__all__ = ["auto_sender", "broadcast_rank", "broadcast_receiver", "broadcast_sender", "inprocess_rank",
           "inprocess_receiver", "inprocess_sender", "shm_rank", "shm_receiver", "shm_sender"]
