"""Escape attempts from commands in the ``local`` sandbox, in every isolation mode this machine has.

These are the commands the ``tool_agent``'s ``bash`` tool runs (it calls ``sandbox.exec``); the
black-box agent's whole program goes the same way (tests/agentflow/test_sandbox_blackbox.py).
Each mode is held to what it promises (``local_sandbox`` module docstring): every mode runs as
an unprivileged user with a scrubbed environment, limits and a whole-tree kill; ``bwrap`` also
makes the file system read-only outside the sandbox; ``bwrap`` and ``netns`` cut the network.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
from loongsage_plugin_agents.local_sandbox import LocalSandboxProvider, detect_isolation
from loongsage_plugin_agents.sandbox_procs import processes, with_argument

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the per-sandbox user needs a root host")

STRENGTH = {"bwrap": 2, "netns": 1, "none": 0}
# a uid pool of this test process's own, so that another run on the machine (whose sandboxes take
# uids from the default pool) never shows up in, or is touched by, the checks of sandbox uids below
UID_BASE = 2_000_000 + (os.getpid() % 5000) * 128
POOL = {"uid_base": UID_BASE, "uid_count": 128}
AVAILABLE = [m for m in ("bwrap", "netns", "none") if STRENGTH[m] <= STRENGTH[detect_isolation(UID_BASE - 1,
                                                                                                UID_BASE - 1)]]


def run(coro):
    return asyncio.run(coro)


def test_every_mode_is_exercised_on_this_machine():
    # this machine has bubblewrap, so none of the modes below is skipped here
    assert AVAILABLE == ["bwrap", "netns", "none"]


def _wait_gone(marker: str, seconds: float = 5.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while with_argument(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return with_argument(marker)


def _unique(prefix: str) -> str:
    """A sleep length unique to this test process: it names its sleeps on the host."""
    return f"{prefix}.{os.getpid():07d}{time.monotonic_ns() % 1000:03d}"


@pytest.fixture(params=AVAILABLE)
def provider(slow_fixture, request):
    # the default root (under the system temp directory, which the sandbox users can enter)
    p = LocalSandboxProvider(isolation=request.param, **POOL, default_timeout_s=30, max_processes=64,
                             memory_mb=512, cpu_time_s=20)
    yield p
    run(p.close())


def test_file_system_home_and_environment(provider, monkeypatch):
    monkeypatch.setenv("LOONGSAGE_TEST_SECRET", "hunter2")  # a host secret commands must not see
    # a directory everyone may write to, where the sandbox's user can reach it (not under /tmp,
    # which bubblewrap replaces, nor under pytest's private temp directory, nor in the checkout,
    # which may itself be under /tmp)
    open_dir = (Path("/var/tmp") if os.access("/var/tmp", os.W_OK) else Path(__file__).resolve().parent) \
        / f".open_probe_{os.getpid()}"
    open_dir.mkdir(exist_ok=True)
    os.chmod(open_dir, 0o777)
    home_probe = Path.home() / f"loongsage_probe_{os.getpid()}"
    repo_probe = Path(__file__).resolve().parent / f"loongsage_probe_{os.getpid()}"
    etc_probe = Path(f"/etc/loongsage_probe_{os.getpid()}")
    secret_file = Path.home() / f".loongsage_secret_{os.getpid()}"
    secret_file.write_text("top secret")

    async def scenario():
        box = await provider.create("fs")
        out = {
            "home": await box.exec(f"cat {secret_file}; ls {Path.home()}"),
            "shadow": await box.exec("cat /etc/shadow"),
            "writes": await box.exec(f"touch {home_probe}; touch {repo_probe}; touch {etc_probe}; "
                                     f"echo x > {box.path}/../sibling; echo $?"),
            "open": await box.exec(f"echo x > {open_dir}/probe"),
            "env": await box.exec("env"),
            "id": await box.exec("id -u"),
            "inside": await box.exec("echo ok > mine.txt && cat mine.txt"),
        }
        await provider.destroy(box)
        return out

    try:
        out = run(scenario())
    finally:
        leaked = [p for p in (home_probe, repo_probe, etc_probe) if p.exists()]
        for p in leaked:
            p.unlink()
        secret_file.unlink()
        opened = list(open_dir.iterdir())
        shutil.rmtree(open_dir)
    assert leaked == []
    assert "top secret" not in out["home"].stdout and "Permission denied" in out["home"].stderr
    assert out["shadow"].exit_code != 0 and out["shadow"].stdout == ""
    assert not (Path(provider.root) / "sibling").exists()
    assert out["inside"].stdout == "ok\n"
    if provider.isolation != "netns":  # (under `unshare -r` the sandbox's uid shows as 0 of its own namespace)
        assert int(out["id"].stdout) >= UID_BASE
    env = dict(line.split("=", 1) for line in out["env"].stdout.splitlines() if "=" in line)
    assert "LOONGSAGE_TEST_SECRET" not in env and "hunter2" not in out["env"].stdout
    assert set(env) <= {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONDONTWRITEBYTECODE", "LOONGSAGE_SANDBOX", "PWD",
                        "SHLVL", "_", "OLDPWD"}
    if provider.isolation == "bwrap":  # read-only outside the sandbox, even where everyone may write
        assert opened == [] and "Read-only file system" in out["open"].stderr
    else:  # permissions only: a world-writable directory is writable (the documented weaker mode)
        assert [p.name for p in opened] == ["probe"]
        assert provider.warnings and "weaker isolation" in provider.warnings[0]


def test_network_reaches_nothing_outside(provider):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    port = server.getsockname()[1]
    accepted: list = []

    def accept():
        try:
            while True:
                accepted.append(server.accept())
        except OSError:
            return

    threading.Thread(target=accept, daemon=True).start()

    async def scenario():
        box = await provider.create("net")
        code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')"
        res = await box.exec(f"python3 -c \"{code}\"")
        await provider.destroy(box)
        return res

    res = run(scenario())
    server.close()
    if provider.isolation == "none":  # no namespace: the network is open, and the provider says so
        assert provider.enforced["network"] == "allowed" and "network is open" in provider.warnings[0]
    else:
        assert res.exit_code != 0 and "connected" not in res.stdout
        assert accepted == []


def test_fork_bomb_memory_hog_and_endless_command(provider):
    marker = _unique("41")

    async def scenario():
        box = await provider.create("limits")
        started = time.monotonic()
        bomb = await box.exec("bomb() { bomb | bomb & }; bomb; sleep 100", timeout_s=4)
        bomb_s = time.monotonic() - started
        left_by_bomb = [p.pid for p in processes() if p.uid == box.uid]
        hog = await box.exec("python3 -c \"x = bytearray(3 * 1024 ** 3)\"")
        started = time.monotonic()  # the timeout also covers the sandbox's start (seconds on a loaded machine)
        endless = await box.exec(f"setsid sleep {marker} & nohup sleep {marker} >/dev/null 2>&1 & "
                                 f"(sleep {marker} &) ; echo started; while true; do :; done", timeout_s=5)
        endless_s = time.monotonic() - started
        after_timeout = _wait_gone(marker)
        alive = await box.exec("echo alive")
        await provider.destroy(box)
        return bomb, bomb_s, left_by_bomb, hog, endless, endless_s, after_timeout, alive

    bomb, bomb_s, left_by_bomb, hog, endless, endless_s, after_timeout, alive = run(scenario())
    assert bomb.timed_out and bomb_s < 20
    assert left_by_bomb == []  # the command's timeout took the whole bomb down
    assert hog.exit_code != 0 and "MemoryError" in hog.stderr
    assert endless.timed_out and endless.exit_code == 124 and endless.stdout == "started\n" and endless_s < 20
    assert after_timeout == []  # setsid / nohup / double-forked children died with the command
    assert alive.stdout == "alive\n"  # the sandbox is still usable after all that


def test_nothing_outlives_destroy(provider):
    marker = _unique("42")

    async def scenario():
        box = await provider.create("daemon")
        res = await box.exec(f"setsid nohup sleep {marker} >/dev/null 2>&1 & echo $!")
        running = with_argument(marker) if provider.isolation != "bwrap" else []
        await provider.destroy(box)
        return res, running, box

    res, running, box = run(scenario())
    assert res.exit_code == 0
    if provider.isolation != "bwrap":  # outside bubblewrap a daemon survives its command...
        assert running
    assert _wait_gone(marker) == []  # ...but never the sandbox
    assert not os.path.exists(box.path)
    assert [p.pid for p in processes() if p.uid == box.uid] == []


def test_output_is_capped_while_read(provider):
    async def scenario():
        box = await provider.create("flood")
        res = await box.exec("head -c 50000000 /dev/zero | tr '\\0' a; echo done >&2")
        await provider.destroy(box)
        return res

    res = run(scenario())
    assert res.exit_code == 0 and res.truncated
    assert len(res.stdout) == provider.max_output_bytes and res.stderr == "done\n"


def test_trajectory_time_budget():
    provider = LocalSandboxProvider(trajectory_timeout_s=2, default_timeout_s=30, **POOL)

    async def scenario():
        box = await provider.create("budget")
        first = await box.exec("sleep 10")
        second = await box.exec("echo late")
        reward_side = box.run("echo scored")  # rewards are bounded by their own timeout, not the agent's budget
        await provider.close()
        return first, second, reward_side

    first, second, reward_side = run(scenario())
    assert first.timed_out and second.timed_out and "time budget" in second.stderr
    assert reward_side.stdout == "scored\n"


def test_a_cli_agent_runs_inside_the_sandbox_and_reaches_only_its_endpoint(tmp_path, monkeypatch):
    import http.server
    import tempfile as _tempfile

    from loongsage_plugin_agents.cli_agents import ClaudeCodeAgent

    from loongsage_hookspecs import AgentContext

    monkeypatch.setenv("LOONGSAGE_TEST_SECRET", "hunter2")

    class Endpoint(http.server.BaseHTTPRequestHandler):  # stands in for the router
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"router says hi")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    # the CLI where the sandbox's user can read it (pytest's temp directory is private to root)
    where = Path(_tempfile.mkdtemp(dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    os.chmod(where, 0o755)
    cli = where / "claude"
    cli.write_text("#!/bin/sh\n"
                   'id -u > uid.txt; echo "$HOME" > home.txt; env > env.txt\n'
                   "python3 -c \"import os, urllib.request; print(urllib.request.urlopen("
                   "os.environ['ANTHROPIC_BASE_URL'] + '/x', timeout=5).read().decode())\" > reached.txt 2>&1\n"
                   "printf '{\"type\":\"result\",\"is_error\":false,\"result\":\"ok\"}'\n")
    os.chmod(cli, 0o755)
    provider = LocalSandboxProvider(isolation="bwrap", default_timeout_s=30, **POOL)

    async def scenario():
        box = await provider.create("cli")
        ctx = AgentContext(trajectory_id="cli", base_url=f"http://127.0.0.1:{port}/cli/0/v1", api_key="k",
                           prompt="hi", sandbox=box)
        result = await ClaudeCodeAgent(binary=str(cli), timeout_s=30).run(ctx)
        await provider.destroy(box)
        return result, box

    try:
        result, box = run(scenario())
    finally:
        server.shutdown()
        shutil.rmtree(where)
    changed = result.metadata["changed_files"]
    assert result.response_text == "ok" and result.metadata["sandboxed"] is True
    assert int(changed["uid.txt"]) >= UID_BASE
    assert changed["home.txt"].startswith(box.home)
    assert "hunter2" not in changed["env.txt"]
    assert changed["reached.txt"].strip() == "router says hi"  # through the sandbox's bridge, in a netns
