"""Weight-update process groups: a trainer rank and rollout engines joined for broadcasts.

A weight transport that broadcasts (the torch plugin's ``broadcast``, the sglang plugin's
``sglang_nccl``) needs a ``torch.distributed`` group of its own beside any group the trainer
already belongs to (its data/tensor-parallel world). SGLang's ``/init_weights_update_group``
fixes the shape: the trainer is rank 0 and hosts a TCP store on ``master_port`` (opened first with
:func:`loongsage_core.rendezvous.host_rendezvous`, so the port is bound before any engine is told
it); each engine rank joins as ``rank_offset + i``; the store is namespaced by ``group_name`` so several groups can
share one port's lifetime without clashing. The sender side and every receiver (an engine built
on this project, or a stand-in) call :func:`init_weight_update_group` with the same arguments
except the rank; the group is set up once and reused for every update.
"""

from __future__ import annotations

import inspect
import os
import socket
import sys
from concurrent.futures import FIRST_EXCEPTION, Executor, wait
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

if TYPE_CHECKING:
    from .rendezvous import Rendezvous


NODE_ID_ENV = "LOONGSAGE_NODE_ID"


def node_id() -> str:
    """Who shares this machine's memory, as a weight transport picking a path per engine compares
    it: ``$LOONGSAGE_NODE_ID`` when set; else, in a Ray cluster (a driver or an actor), Ray's node
    id, so that two Ray nodes started on one machine (one IP, separate object stores) count as two;
    else the host name and the kernel's boot id. Two processes with the same id can exchange
    weights through shared memory; others need the network. Ray is only consulted when already
    imported (it is never imported for this)."""
    explicit = os.environ.get(NODE_ID_ENV)
    if explicit:
        return explicit
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        try:
            return f"ray:{ray.get_runtime_context().get_node_id()}"
        except Exception:  # noqa: BLE001 - a half torn-down worker: fall back to the machine's id
            pass
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"


def resolve_backend(backend: str, device: str | None = None) -> str:
    """``"auto"`` -> ``"nccl"`` when the tensors live on CUDA, else ``"gloo"``; other names pass."""
    if backend != "auto":
        return backend
    if device is not None:
        return "nccl" if str(device).startswith("cuda") else "gloo"
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int, *,
                             group_name: str, backend: str = "nccl", timeout_s: float = 600.0,
                             store: Any = None) -> Any:
    """Join a process group of its own (beside any default group) and return it.

    Every member calls this with the same address, port, world size and group name: rank 0
    hosts the TCP store (``store``: the one it opened with ``host_rendezvous``, else it listens on
    ``master_port`` here), and the group is registered with ``torch.distributed`` so collectives
    accept it as ``group=`` and ranks inside it are the ranks given here.
    """
    from torch.distributed import distributed_c10d as c10d

    from .rendezvous import pin_gloo_to_this_node

    if not 0 <= int(rank) < int(world_size):
        raise ValueError(f"weight update group {group_name!r}: rank {rank} is outside world size {world_size}")
    if store is not None and int(rank) != 0:
        raise ValueError(f"weight update group {group_name!r}: only rank 0 hosts the store, got rank {rank}")
    timeout = timedelta(seconds=timeout_s)
    pin_gloo_to_this_node()  # a Gloo group listens on the node's address alone (loopback on one node)
    if store is None:
        store, rank, world_size = next(c10d.rendezvous(f"tcp://{master_address}:{int(master_port)}", int(rank),
                                                       int(world_size), timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    # the keyword naming backend options changed across torch releases
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = {"backend_options": None} if "backend_options" in params else {"pg_options": None}
    # torch types the name as ``GroupName``, a NewType of str (a string here: older torch lacks it)
    name = cast("c10d.GroupName", group_name)
    group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                              group_name=name, timeout=timeout, **options)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def join_with_engines(pool: Executor, engine_joins: Sequence[Callable[[], Any]], rendezvous: "Rendezvous",
                      world_size: int, *, group_name: str, backend: str, timeout_s: float, where: str) -> Any:
    """Set up a group as its rank 0 while every engine is asked to join; returns the group.

    ``rendezvous`` is the store this process opened (``host_rendezvous``) before the engines were
    told its address and port; ``engine_joins`` are the engines' join requests (each a
    ``POST /init_weights_update_group``), run in ``pool`` beside this process's own join. An engine
    that refuses to join fails the set-up at once instead of after the rendezvous timeout;
    ``where`` names the caller in errors.
    """
    master_address, master_port = rendezvous.address, rendezvous.port
    joins = [pool.submit(join) for join in engine_joins]
    group = pool.submit(init_weight_update_group, master_address, master_port, 0, world_size,
                        group_name=group_name, backend=backend, timeout_s=timeout_s, store=rendezvous.store)
    done, _ = wait([*joins, group], timeout=timeout_s + 60, return_when=FIRST_EXCEPTION)
    for fut in done:
        fut.result()
    if len(done) < len(joins) + 1:
        raise TimeoutError(f"{where}: the weight update group {group_name!r} was not set up within {timeout_s:g} s "
                           f"(rendezvous {master_address}:{master_port}, world size {world_size})")
    return group.result()


def destroy_weight_update_group(group: Any) -> None:
    """Leave ``group`` (best effort: a peer that already left is no error at teardown)."""
    import torch.distributed as dist

    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - the group may be half torn down by a peer's exit
        pass
