"""Ports without a check-then-use race (loongsage_core.rendezvous): the listener picks the port."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
import textwrap

import pytest

from loongsage_core.rendezvous import (
    LOOPBACK,
    host_rendezvous,
    is_address_in_use,
    reachable_address,
    retry_on_port_collision,
)

TWO_RANKS = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from loongsage_core.rendezvous import host_rendezvous

    def rank(r, ports):
        if r == 0:
            rendezvous = host_rendezvous()  # listening before rank 1 hears of the port
            ports.put(rendezvous.port)
            port = rendezvous.port
        else:
            port = ports.get(timeout=120)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
        t = torch.tensor([float(r + 1)])
        dist.all_reduce(t)
        assert t.item() == 3.0, t
        dist.destroy_process_group()

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        ports = ctx.Queue()
        procs = [ctx.Process(target=rank, args=(r, ports)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=240)
        sys.exit(max(p.exitcode if p.exitcode is not None else 99 for p in procs))
""")


@pytest.mark.slow
def test_rank_0_group_shares_the_listener_it_opened_first(tmp_path):
    # rank 0's own init_process_group on the reported port must reuse its listener, not bind again
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_the_store_listens_before_anyone_joins():
    rendezvous = host_rendezvous(LOOPBACK)  # named: Ray may be up in this process (another test's cluster)
    try:
        assert rendezvous.address == LOOPBACK and rendezvous.port > 0
        assert rendezvous.init_method == f"tcp://127.0.0.1:{rendezvous.port}"
        with socket.create_connection((LOOPBACK, rendezvous.port), timeout=10):
            pass  # the port is already bound and accepting: nobody else can take it
        with socket.socket() as other, pytest.raises(OSError) as err:
            other.bind((LOOPBACK, rendezvous.port))
        assert err.value.errno == errno.EADDRINUSE
    finally:
        rendezvous.close()


def test_an_explicit_port_that_is_taken_fails_naming_it():
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"rendezvous: could not listen on 127.0.0.1:{port}"):
            host_rendezvous(LOOPBACK, port, timeout_s=5)


def test_outside_ray_the_reachable_address_is_loopback():
    # a fresh interpreter: this one may hold another test's Ray cluster
    code = "from loongsage_core.rendezvous import reachable_address; print(reachable_address())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == LOOPBACK, done.stderr


def test_in_ray_the_reachable_address_is_the_node_ip(ray_cluster):
    node_ip = ray_cluster.util.get_node_ip_address()
    assert reachable_address() == node_ip
    rendezvous = host_rendezvous()
    try:
        assert rendezvous.address == node_ip
        with socket.create_connection((node_ip, rendezvous.port), timeout=10):
            pass  # reachable at the address it reports
    finally:
        rendezvous.close()


def test_a_collision_is_retried_on_another_port_and_other_errors_are_not():
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        busy = taken.getsockname()[1]
        tried: list[int] = []
        listeners: list[socket.socket] = []

        def start(port: int) -> int:  # what a child server does: bind the port it was given
            tried.append(port)
            s = socket.socket()
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                s.close()
                raise
            listeners.append(s)
            return port

        try:
            got = retry_on_port_collision(start, first_port=busy, where="test server")
        finally:
            for s in listeners:
                s.close()
        assert tried[0] == busy and got == tried[-1] != busy and len(tried) == 2

    def broken(port: int) -> int:
        tried.append(port)
        raise ValueError("bad flag --frobnicate")

    tried.clear()
    with pytest.raises(ValueError, match="frobnicate"):
        retry_on_port_collision(broken)
    assert len(tried) == 1  # not a collision: no second attempt

    def always_taken(port: int) -> int:
        raise RuntimeError("server exited with status 1\nOSError: [Errno 98] Address already in use")

    with pytest.raises(RuntimeError, match="test server: every one of 3 ports"):
        retry_on_port_collision(always_taken, attempts=3, where="test server")


def test_collisions_are_recognised_in_errors_and_their_causes():
    assert is_address_in_use(OSError(errno.EADDRINUSE, "Address already in use"))
    assert is_address_in_use(RuntimeError("sglang router exited\n--- log ---\nAddress already in use (os error 98)"))
    try:
        try:
            raise OSError(errno.EADDRINUSE, "bind")
        except OSError as inner:
            raise RuntimeError("could not start") from inner
    except RuntimeError as outer:
        assert is_address_in_use(outer)
    assert not is_address_in_use(RuntimeError("exited with status 3: loading weights failed"))
    assert not is_address_in_use(OSError(errno.ECONNREFUSED, "Connection refused"))
