"""Agents of loongsage-plugin-agents run through ``run_agent_trajectory``, the router and real engines."""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import textwrap
import time
from pathlib import Path

import pytest

from loongsage_core.agentflow import run_agent_trajectory
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import BuildContext, ComponentRef, Trajectory, TrajectoryStatus

REPO = Path(__file__).resolve().parents[2]
BLACKBOX = REPO / "examples" / "blackbox_agent.py"
# a guard against a hang, not a speed check: a Python agent that imports its client library
# can take tens of seconds to start on a loaded 2-core machine
AGENT_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def agents():
    """``agents(name, args)``: an agent built as a run builds it (the real host binds the agents
    plugin's spec with the job's arguments)."""
    host = PluginHost.create(["agents"])
    return lambda name, args=None: host.bind(ComponentRef("agent", name, args or {}), BuildContext(components=host))


@pytest.fixture(scope="module")
def local_sandbox(slow_fixture):
    from loongsage_plugin_agents import plugin

    return {s.name: s for s in plugin.loongsage_sandboxes()}["local"].factory(BuildContext())


def trajectory(tid: str, prompt) -> Trajectory:
    return Trajectory(id=tid, prompt_id="p0", group_id="g0", prompt=prompt, label="3")


def run(coro):
    return asyncio.run(coro)


def test_single_turn_agent(engine_url, router_factory, agents, renderer):
    router = router_factory([engine_url])
    traj = run(run_agent_trajectory(router, agents("single_turn", {"system_prompt": "Be brief."}), None,
                                    trajectory=trajectory("st-1", "What is 1+2?"),
                                    sampling={"max_new_tokens": 10, "seed": 3}, timeout_s=AGENT_TIMEOUT_S))
    assert traj.status == TrajectoryStatus.COMPLETED and traj.error is None
    [seg] = traj.segments
    generated = [t for t, m in zip(seg.tokens, seg.loss_mask) if m]
    assert traj.response_text == renderer.content_of(generated)
    assert [m["role"] for m in traj.messages] == ["system", "user", "assistant"]
    assert traj.response_length == len(generated) > 0
    assert traj.metadata["agentflow"]["turns"] == 1
    with pytest.raises(KeyError):  # collected: the router forgot it
        router.blocking.get("st-1")


def test_tool_agent_calls_python_tools_and_destroys_its_sandbox(tool_engine_url, router_factory, agents, tmp_path,
                                                                 renderer):
    from loongsage_plugin_agents.local_sandbox import LocalSandboxProvider
    from loongsage_plugin_agents.tool_parser import ToolCallParser

    seen = tmp_path / "sandboxes_seen.txt"
    tools = tmp_path / "my_tools.py"
    tools.write_text(textwrap.dedent(f'''
        import os

        def add(a: int = 1, b: int = 2, sandbox=None) -> int:
            """Add two integers.

            Args:
                a: the first number
                b: the second number
            """
            with open({str(seen)!r}, "a") as f:  # the agent injects the trajectory's sandbox
                f.write(f"{{sandbox.workdir}} {{os.path.isdir(sandbox.workdir)}}\\n")
            return a + b
    '''))
    provider = LocalSandboxProvider()
    router = router_factory([tool_engine_url], [ToolCallParser()])
    traj = run(run_agent_trajectory(router, agents("tool_agent", {"tools": [f"{tools}:add"], "max_turns": 3}),
                                    provider, trajectory=trajectory("ta-1", "What is 1+2?"),
                                    sampling={"max_new_tokens": 32}, timeout_s=AGENT_TIMEOUT_S))
    assert traj.status == TrajectoryStatus.COMPLETED, traj.error
    roles = [m["role"] for m in traj.messages]
    assert roles == ["user"] + ["assistant", "tool"] * 3
    assert [m["content"] for m in traj.messages if m["role"] == "tool"] == ["3", "3", "3"]
    assert traj.metadata["agentflow"]["agent"] == {"turns": 3, "tool_calls": 3, "finish_reason": "tool_calls"}
    [seg] = traj.segments
    assert len(seg.turns) == 3
    text = renderer.decode(seg.tokens)
    # the last tool result was never sent back to the model, so the record has two
    assert text.count("<tool_response>\n3\n</tool_response>") == 2
    assert '"name": "bash"' in text and '"name": "add"' in text  # both tools were offered
    [(workdir, existed)] = {tuple(line.split()) for line in seen.read_text().splitlines()}
    assert existed == "True" and not os.path.exists(workdir)  # it existed during the run, and is gone


@pytest.mark.slow
def test_command_agent_runs_the_blackbox_example(engine_url, router_factory, agents):
    router = router_factory([engine_url])
    args = {"command": [sys.executable, str(BLACKBOX), "--turns", "2", "--max-tokens", "8"]}
    traj = run(run_agent_trajectory(router, agents("command", args), None,
                                    trajectory=trajectory("cmd-1", "What is 1+2?"),
                                    sampling={"seed": 9}, timeout_s=AGENT_TIMEOUT_S))
    assert traj.status == TrajectoryStatus.COMPLETED, traj.error
    [seg] = traj.segments  # the second request extended the first: one segment, two model turns
    assert len(seg.turns) == 2
    assert traj.messages[-1]["role"] == "assistant"
    assert traj.response_text == (traj.messages[-1]["content"] or "").strip()
    assert traj.messages[1]["content"] == "What is 1+2?"


def test_crashing_command_agent_marks_the_trajectory_failed(engine_url, router_factory, agents, local_sandbox):
    router = router_factory([engine_url])
    # in the sandbox: an interpreter its unprivileged user may run
    crash = [local_sandbox.python, "-c", "import sys; print('oops', file=sys.stderr); sys.exit(3)"]
    traj = run(run_agent_trajectory(router, agents("command", {"command": crash}), local_sandbox,
                                    trajectory=trajectory("crash-1", "x"), needs_sandbox=True, timeout_s=30))
    assert traj.status == TrajectoryStatus.FAILED
    assert "exited with status 3" in traj.error and "oops" in traj.error
    assert traj.segments == [] and traj.response_text == ""
    with pytest.raises(KeyError):
        router.blocking.get("crash-1")


def test_agent_that_outgrows_the_context_is_marked_failed(engine_url, router_factory, agents):
    router = router_factory([engine_url])
    # a black-box agent that ignores the 400 it gets and exits normally
    script = ("import json, os, urllib.request, urllib.error\n"
              "body = json.dumps({'model': 'p', 'messages': [{'role': 'user', 'content': 'word ' * 3000}]})\n"
              "req = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/chat/completions', body.encode(),\n"
              "                             {'Content-Type': 'application/json'})\n"
              "try:\n    urllib.request.urlopen(req)\nexcept urllib.error.HTTPError as exc:\n"
              "    print(exc.code, json.load(exc)['error']['code'])\n")
    traj = run(run_agent_trajectory(router, agents("command", {"command": [sys.executable, "-c", script]}), None,
                                    trajectory=trajectory("ctx-1", "x"), timeout_s=AGENT_TIMEOUT_S))
    assert traj.status == TrajectoryStatus.FAILED
    assert traj.error.startswith("context_length_exceeded") and "1024 tokens" in traj.error
    assert traj.segments == []


@pytest.mark.slow
def test_hanging_command_agent_times_out_and_is_killed(engine_url, router_factory, agents, tmp_path):
    router = router_factory([engine_url])
    pid_file = tmp_path / "pid"
    # a shell writes its pid at once and becomes the sleep (exec: the same pid); a Python program
    # could still be starting after the 3 s on a busy machine, leaving no pid to check
    hang = ["/bin/sh", "-c", f"echo $$ > {shlex.quote(str(pid_file))}; exec sleep 60"]
    for label, agent_args, runner_timeout in (("agent", {"command": hang, "timeout_s": 3.0}, 30),
                                              ("runner", {"command": hang}, 3.0)):
        started = time.monotonic()
        traj = run(run_agent_trajectory(router, agents("command", agent_args), None,
                                        trajectory=trajectory(f"hang-{label}", "x"), timeout_s=runner_timeout))
        assert time.monotonic() - started < 20  # not the program's 60 s
        assert traj.status == TrajectoryStatus.FAILED
        assert "did not finish within 3s" in traj.error if label == "agent" else "timed out after 3s" in traj.error
        pid = int(pid_file.read_text())
        deadline = time.time() + 5
        while _alive(pid) and time.time() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), f"the {label}-timeout left the program running"
        pid_file.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_host_abort_marks_the_trajectory_aborted(engine_url, router_factory, agents):
    router = router_factory([engine_url])
    args = {"command": [sys.executable, str(BLACKBOX), "--turns", "50", "--max-tokens", "4"]}

    async def scenario():
        task = asyncio.create_task(run_agent_trajectory(
            router, agents("command", args), None, trajectory=trajectory("abort-1", "x"), timeout_s=AGENT_TIMEOUT_S))
        while True:  # wait until the agent has made its first call
            await asyncio.sleep(0.02)
            try:
                if (await router.aget("abort-1")).turns:
                    break
            except KeyError:
                pass
        await router.aabort("abort-1")
        return await task

    traj = run(scenario())
    assert traj.status == TrajectoryStatus.ABORTED
    assert "409" in traj.error or "aborted" in traj.error
    assert traj.segments and traj.segments[0].trainable  # what was generated before the abort is kept
