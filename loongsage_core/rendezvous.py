"""Ports without a check-then-use race: the process that listens picks the port and reports it.

Picking a "free" port in one place and binding it later in another (a spawned rank, a child
server) races with every other process on the machine: on a busy host the port is taken in
between and the bind fails with ``EADDRINUSE``. Two ways out, one per situation:

* **A ``torch.distributed`` rendezvous** (trainer ranks, critic ranks, weight-update groups): the
  future rank 0 calls :func:`host_rendezvous` in its own process *before* anyone joins. It opens
  the TCP store's listener on a port the OS assigns (port 0), on the address the run uses alone
  (loopback on one node), and returns ``(address, port)`` for
  the other ranks; rank 0's own ``init_process_group(init_method="tcp://address:port", rank=0)``
  then shares that listener (torch's TCP stores are multi-tenant per process and port), and a
  caller that builds its group itself passes :attr:`Rendezvous.store`. One rendezvous serves one
  group: open a new one for each group.
* **A child program given a port on its command line** (an SGLang server, its router): the port
  cannot be bound for it, so :func:`retry_on_port_collision` starts it on :func:`free_port` and
  starts it again on a new port when it fails because the address was in use.

:func:`reachable_address` is the address other processes reach this one at: the node IP Ray
assigned when this process belongs to a Ray cluster, else loopback.
"""

from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from typing import Any, Callable, TypeVar

import attrs

LOOPBACK = "127.0.0.1"
LISTEN_BACKLOG = 512
"""Pending connections the rendezvous listener queues (every rank of a large group at once)."""
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
T = TypeVar("T")

ADDRESS_IN_USE_MARKERS = ("address already in use", "eaddrinuse", "errno 98", "address in use")
"""Lower-case phrases that mark a failed bind in an error or a child program's log."""


def reachable_address() -> str:
    """The IP address other processes reach this one at: Ray's node IP when this process is part
    of a Ray cluster (a driver or an actor), else loopback. Ray is only consulted when already
    imported (it is never imported for this)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        try:
            return str(ray.util.get_node_ip_address())
        except Exception:  # noqa: BLE001 - a half torn-down worker: loopback is the safe answer
            return LOOPBACK
    return LOOPBACK


@attrs.frozen
class Rendezvous:
    """A listening ``torch.distributed`` TCP store hosted by the future rank 0.

    Keep it alive until every rank has joined (rank 0's own group shares its listener);
    :meth:`close` (or dropping the last reference) stops listening.
    """

    address: str
    """Where the other ranks reach the store (:func:`reachable_address` unless given)."""
    port: int
    """The port the OS assigned (or the one asked for)."""
    store: Any = attrs.field(repr=False, eq=False)
    """The master ``torch.distributed.TCPStore`` (multi-tenant), for callers that build a group on it."""

    @property
    def init_method(self) -> str:
        """``tcp://address:port`` for ``torch.distributed.init_process_group``."""
        return f"tcp://{self.address}:{self.port}"

    def close(self) -> None:
        """Stop listening once this process's group holds the store (best effort)."""
        shutdown = getattr(self.store, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - an already stopped store is no error
                pass


def host_rendezvous(address: str | None = None, port: int = 0, *, timeout_s: float = 600.0) -> Rendezvous:
    """Open rank 0's TCP store on ``port`` (0: a port the OS assigns) in this process.

    ``address`` is what the other ranks are told (default :func:`reachable_address`) and the only
    address the store listens on: torch's ``TCPStore`` would bind every interface and has no
    authentication, so this process binds the socket itself and hands it over
    (``master_listen_fd``); on one node the store is then reachable from loopback alone. Gloo
    groups formed in this process are pinned to the same address (:func:`pin_gloo_to`). Call it in
    the process that will be rank 0, then hand ``(rendezvous.address, rendezvous.port)`` to the
    other ranks. A port given explicitly that is taken fails here, naming it, instead of in a
    rank's rendezvous.
    """
    from torch.distributed import TCPStore

    where = address or reachable_address()
    try:
        family = socket.AF_INET6 if ":" in where else socket.AF_INET
        listener = socket.create_server((where, int(port)), family=family, backlog=LISTEN_BACKLOG)
    except OSError as exc:
        raise RuntimeError(f"rendezvous: could not listen on {where}:{int(port)}: {exc}") from exc
    bound_port = int(listener.getsockname()[1])
    try:  # the store owns the socket from here on (it closes it when it stops)
        store = TCPStore(where, bound_port, is_master=True, wait_for_workers=False, multi_tenant=True,
                         timeout=timedelta(seconds=timeout_s), master_listen_fd=listener.detach())
    except Exception as exc:
        raise RuntimeError(f"rendezvous: could not listen on {where}:{bound_port}: {exc}") from exc
    pin_gloo_to(where)
    return Rendezvous(address=where, port=bound_port, store=store)


def pin_gloo_to(address: str) -> str | None:
    """Make the Gloo process groups this process forms listen on ``address``'s interface alone.

    Gloo opens a listening socket per group on the address the host name resolves to (any
    interface on some hosts) and authenticates nobody; it reads ``GLOO_SOCKET_IFNAME`` when a
    group is formed. This sets it to the interface that holds ``address`` (``lo`` for
    ``127.0.0.1``) unless the user set it; returns the interface in force (``None``: no
    interface holds ``address``, Gloo keeps its own choice).
    """
    if os.environ.get(GLOO_IFNAME_ENV):
        return os.environ[GLOO_IFNAME_ENV]
    import psutil

    for interface, addresses in psutil.net_if_addrs().items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == address
               for a in addresses):
            os.environ[GLOO_IFNAME_ENV] = interface
            return interface
    return None


def pin_gloo_to_this_node() -> str | None:
    """:func:`pin_gloo_to` this process's :func:`reachable_address` (the node IP Ray assigned,
    loopback on a local cluster): call it before joining a Gloo group as a rank other than 0."""
    return pin_gloo_to(reachable_address())


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on ``host`` right now. Only for a child program that must be given its
    port on the command line, and only through :func:`retry_on_port_collision`: between this
    call and the child's bind another process may take it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def is_address_in_use(error: BaseException) -> bool:
    """Whether ``error`` (or its cause chain) says a bind failed because the address was in use."""
    seen: set[int] = set()
    exc: BaseException | None = error
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == 98:
            return True
        if any(marker in str(exc).lower() for marker in ADDRESS_IN_USE_MARKERS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def retry_on_port_collision(start: Callable[[int], T], *, host: str = LOOPBACK, attempts: int = 5,
                            first_port: int | None = None, where: str = "server") -> T:
    """``start(port)`` on a :func:`free_port` (``first_port`` for the first attempt when given),
    again on a new port (up to ``attempts`` times in all) when it fails because another process
    took the port first (:func:`is_address_in_use`).

    ``start`` must clean up after a failed start (stop the child it launched). Any other error
    is raised at once; ``where`` names the server in the error after the last attempt.
    """
    last: BaseException | None = None
    for attempt in range(max(1, int(attempts))):
        port = first_port if attempt == 0 and first_port else free_port(host)
        try:
            return start(port)
        except Exception as exc:
            if not is_address_in_use(exc):
                raise
            last = exc
    raise RuntimeError(f"{where}: every one of {attempts} ports tried on {host} was taken before the "
                       f"server bound it: {last}") from last
