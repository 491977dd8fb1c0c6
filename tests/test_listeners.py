"""Everything a run listens on is on loopback (one node): Ray's servers, the engines, the router,
and the ``torch.distributed`` stores and Gloo groups of the trainer ranks and of the broadcast
weight transport, which torch would otherwise open on every interface without authentication."""

from __future__ import annotations

import ipaddress
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from loongsage_core.rendezvous import LOOPBACK, host_rendezvous


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def listeners(root: psutil.Process) -> dict[tuple[str, int], str]:
    """``(ip, port) -> process`` of every listening TCP socket of ``root`` and its descendants."""
    found: dict[tuple[str, int], str] = {}
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return found
    for proc in procs:
        try:
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found[(conn.laddr.ip, conn.laddr.port)] = " ".join(proc.cmdline()[:2])[:80]
        except psutil.Error:  # the process ended meanwhile
            pass
    return found


def test_the_rendezvous_store_listens_on_its_address_alone():
    rendezvous = host_rendezvous(LOOPBACK)
    try:
        mine = listeners(psutil.Process())
        assert (LOOPBACK, rendezvous.port) in mine
        assert not any(port == rendezvous.port and ip != LOOPBACK for ip, port in mine), mine
    finally:
        rendezvous.close()


GLOO_RANK_0 = textwrap.dedent("""
    import os, sys
    import torch.distributed as dist
    from loongsage_core.rendezvous import host_rendezvous
    rendezvous = host_rendezvous("127.0.0.1")
    dist.init_process_group("gloo", init_method=rendezvous.init_method, rank=0, world_size=1)
    print(os.environ["GLOO_SOCKET_IFNAME"], flush=True)
    sys.stdin.readline()
""")


def test_a_gloo_group_formed_on_the_rendezvous_listens_on_loopback(tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(GLOO_RANK_0)
    env = {k: v for k, v in __import__("os").environ.items() if k != "GLOO_SOCKET_IFNAME"}
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        interface = proc.stdout.readline().strip()
        assert interface and LOOPBACK in [a.address for a in psutil.net_if_addrs()[interface]]
        found = listeners(psutil.Process(proc.pid))
        assert len(found) >= 2, found  # the store and Gloo's own listener
        assert all(is_loopback(ip) for ip, _ in found), found
    finally:
        proc.communicate("\n", timeout=60)


def test_every_listener_of_a_real_run_is_on_loopback(tiny_job, tmp_path: Path):
    """Separate trainer ranks in a Gloo group, a separate engine fed by the broadcast transport
    (a weight-update group with its own store): every socket the run's process tree listens on,
    sampled through the whole run, is a loopback one."""
    job = tiny_job.write(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "loongsage_core", "run", str(job), "--output-dir",
                             str(tmp_path / "run"), "placement.colocate=false", "rollout.weight_transport=broadcast",
                             "train.num_workers=2", "train.total_steps=1", "run.checkpoint_every=0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    root = psutil.Process(proc.pid)
    seen: dict[tuple[str, int], str] = {}
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        seen.update(listeners(root))
        time.sleep(0.2)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    assert any("ModelActor" in who for who in seen.values()), seen  # the actors were sampled
    assert len(seen) >= 8, seen  # Ray's servers, the engine, the stores and Gloo groups were sampled
    beyond = {addr: who for addr, who in seen.items() if not is_loopback(addr[0])}
    assert not beyond, f"listening beyond loopback: {beyond}"
