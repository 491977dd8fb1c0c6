"""A black-box agent program inside the ``local`` sandbox, through the real router and engine:
it reaches its endpoint and nothing else, and leaves nothing behind; sandboxes stay within
``max_concurrent_sandboxes``; rewards see the sandbox before it is destroyed."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sysconfig
import textwrap
import threading
import time
from pathlib import Path

import pytest
from loongsage_plugin_agents.sandbox_procs import with_argument

from loongsage_core.agentflow import run_agent_trajectory
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import BuildContext, ComponentRef, Trajectory, TrajectoryStatus

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="the per-sandbox user needs a root host"),
              pytest.mark.slow]  # programs in sandboxes (and, with kill and resume, whole runs)

# the program's own packages (openai), readable by the sandbox's user
SITE = sysconfig.get_paths()["purelib"]

PROGRAM = textwrap.dedent('''
    import json, os, socket, subprocess, sys
    from openai import OpenAI

    report = {}
    reply = OpenAI().chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    report["router"] = reply.choices[0].finish_reason is not None
    try:
        socket.create_connection(("127.0.0.1", int(os.environ["OTHER_PORT"])), timeout=2)
        report["other_port"] = "connected"
    except OSError as exc:
        report["other_port"] = type(exc).__name__
    report["writes"] = []
    for path in os.environ["OUTSIDE"].split(":"):
        try:
            open(path, "w").write("x")
            report["writes"].append(path)
        except OSError:
            pass
    try:
        report["home"] = os.listdir(os.environ["HOST_HOME"])
    except OSError as exc:
        report["home"] = type(exc).__name__
    report["env"] = sorted(os.environ)
    subprocess.Popen(["sleep", os.environ["MARKER"]], start_new_session=True, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    print(json.dumps(report))
''')

MODES = ["bwrap", "netns", "none"]
# a uid pool of this test process's own: another run's sandboxes never show up in the uid checks
POOL = {"uid_base": 2_000_000 + (os.getpid() % 5000) * 128, "uid_count": 128}


@pytest.fixture(scope="module")
def agents():
    """``agents(name, args)``: an agent built as a run builds it (the real host binds the agents
    plugin's spec with the job's arguments)."""
    host = PluginHost.create(["agents"])
    return lambda name, args=None: host.bind(ComponentRef("agent", name, args or {}), BuildContext(components=host))


@pytest.mark.parametrize("isolation", MODES)
def test_blackbox_program_reaches_the_router_only_and_leaves_nothing(isolation, engine_url, router_factory, agents,
                                                                    tmp_path):
    from loongsage_plugin_agents.local_sandbox import LocalSandboxProvider

    provider = LocalSandboxProvider(isolation=isolation, default_timeout_s=60, **POOL)
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "agent.py").write_text(PROGRAM)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    accepted: list = []

    def accept():
        try:
            while True:
                accepted.append(server.accept())
        except OSError:
            return

    threading.Thread(target=accept, daemon=True).start()
    marker = f"43.{os.getpid():07d}{time.monotonic_ns() % 1000:03d}"
    outside = [str(Path.home() / f"bb_probe_{os.getpid()}"), f"/etc/bb_probe_{os.getpid()}",
               str(Path(__file__).resolve().parent / f"bb_probe_{os.getpid()}")]
    args = {"command": [provider.python, "agent.py"], "stdin": False,
            "env": {"PYTHONPATH": SITE, "OTHER_PORT": str(server.getsockname()[1]), "OUTSIDE": ":".join(outside),
                    "HOST_HOME": str(Path.home()), "MARKER": marker}}
    router = router_factory([engine_url])
    traj = Trajectory(id=f"bb-{isolation}", prompt_id="p0", group_id="g0", prompt="hi",
                      metadata={"sandbox": {"snapshot": str(repo)}})
    try:
        traj = asyncio.run(run_agent_trajectory(router, agents("command", args), provider, trajectory=traj,
                                                sampling={"max_new_tokens": 4}, timeout_s=120))
        asyncio.run(provider.close())
    finally:
        server.close()
        leaked = [p for p in outside if os.path.exists(p)]
        for p in leaked:
            os.unlink(p)
    assert traj.status == TrajectoryStatus.COMPLETED, traj.error
    report = json.loads(traj.response_text)
    assert report["router"] is True and len(traj.segments) == 1  # its endpoint works, and was recorded
    assert report["writes"] == [] and leaked == []
    assert report["home"] == "PermissionError"
    assert set(report["env"]) <= {"OPENAI_BASE_URL", "OPENAI_API_KEY", "LOONGSAGE_PROMPT", "LOONGSAGE_PROMPT_FILE",
                                  "LOONGSAGE_RESULT_FILE", "LOONGSAGE_TRAJECTORY_ID", "PYTHONPATH", "OTHER_PORT",
                                  "OUTSIDE", "HOST_HOME", "MARKER", "PATH", "HOME", "TMPDIR", "LANG",
                                  "PYTHONDONTWRITEBYTECODE", "LOONGSAGE_SANDBOX", "PWD", "SHLVL", "_", "LC_CTYPE"}
    if isolation == "none":  # no network namespace: the open network is the documented weaker mode
        assert "network is open" in " ".join(traj.metadata["sandbox"]["warnings"])
    else:
        assert report["other_port"] != "connected" and accepted == []
    assert traj.metadata["sandbox"]["isolation"] == isolation
    assert traj.metadata["agentflow"]["agent"]["sandboxed"] is True
    deadline = time.monotonic() + 5
    while with_argument(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert with_argument(marker) == []  # the program's detached child did not outlive the trajectory
    assert not [e for e in os.listdir(provider.root) if e.startswith(f"{os.getpid()}-")
                and "bb-" in e]


def test_sixteen_trajectories_never_hold_more_than_four_sandboxes(engine_url, router_factory, agents):
    from loongsage_plugin_agents.local_sandbox import LocalSandboxProvider
    from loongsage_plugin_agents.sandbox_procs import processes

    provider = LocalSandboxProvider(max_concurrent_sandboxes=4, default_timeout_s=60, **POOL)
    router = router_factory([engine_url])
    counts: list[int] = []
    stop = threading.Event()

    def observe():  # counts the sandbox directories on disk, independently of the provider's books
        while not stop.is_set():
            if provider.registry is not None:
                prefix = provider.registry.prefix()
                counts.append(sum(e.startswith(prefix) for e in os.listdir(provider.root)))
            time.sleep(0.005)

    uids: set[int] = set()

    async def score(traj, sandbox):
        uids.add(sandbox.uid)
        res = await asyncio.to_thread(sandbox.run, "cat answer.txt")
        traj.metadata["seen_by_reward"] = res.stdout.strip()

    async def scenario():
        args = {"command": ["sh", "-c", "sleep 0.4; echo $LOONGSAGE_TRAJECTORY_ID > answer.txt; echo done"]}
        return await asyncio.gather(*(
            run_agent_trajectory(router, agents("command", args), provider,
                                 trajectory=Trajectory(id=f"c-{i}", prompt_id="p", group_id="g", prompt="x"),
                                 timeout_s=120, score=score) for i in range(16)))

    watcher = threading.Thread(target=observe, daemon=True)
    watcher.start()
    trajs = asyncio.run(scenario())
    stop.set()
    watcher.join()
    assert all(t.status == TrajectoryStatus.COMPLETED for t in trajs), [t.error for t in trajs]
    # the reward ran in each trajectory's own sandbox, before it was destroyed
    assert [t.metadata["seen_by_reward"] for t in trajs] == [f"c-{i}" for i in range(16)]
    assert max(counts) <= 4 and provider.peak_live == 4
    assert provider.live == 0 and not [e for e in os.listdir(provider.root) if e.startswith(provider.registry.prefix())]
    assert [p.pid for p in processes() if p.uid in uids] == []
    for t in trajs:
        assert t.metadata["sandbox"]["sandbox_create_s"] >= 0 and t.metadata["sandbox"]["sandbox_teardown_s"] >= 0
    asyncio.run(provider.close())
