"""The real agent CLIs (Codex, Claude Code, OpenCode) against the real router and engine.

The CLIs come from ``scripts/install_agent_clis.sh`` (run by ``scripts/setup.sh``) at pinned
versions; a missing one fails these tests with the install command. The policy is the agent
fixture model (tests/data/agent_model, made by scripts/make_agent_model.py): a tiny Qwen3 with a
64K context and sliding-window attention that answers a user turn with one hermes tool call
(``bash`` writing hello.txt) and a tool result with ``Done.``. Each CLI sends its real
10-20K-token prompt; the engine's prefix cache makes the second turn prefill only the tool result.
OpenCode runs the call; Codex and Claude Code have no tool called ``bash`` and send back their
error as the tool result, which is a round trip all the same.

Claude Code runs with its default tool set, which renders to about 34K tokens with the test
tokenizer's 512-token vocabulary: the fixture's 64K context holds it.
"""

from __future__ import annotations

import asyncio
import json
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from loongsage_core.agentflow import run_agent_trajectory
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import BuildContext, ComponentRef, Trajectory, TrajectoryStatus

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "tests" / "data" / "agent_model"
CONTEXT = 65536
ENGINE_ARGS = {"max_prefill_tokens": 4096, "prefix_cache_tokens": 131072}
CLI_ARGS: dict[str, dict[str, Any]] = {
    "codex": {},
    "claude_code": {},
    "opencode": {},
}
PROMPT = "Create the file hello.txt with the word hello in it."


@pytest.fixture(scope="module")
def agents():
    """``agents(name, args)``: an agent built as a run builds it (the real host binds the agents
    plugin's spec with the job's arguments)."""
    host = PluginHost.create(["agents"])
    return lambda name, args=None: host.bind(ComponentRef("agent", name, args or {}), BuildContext(components=host))


@pytest.fixture(scope="module")
def served(slow_fixture):
    """A real embedded engine with the agent fixture model and a router with the hermes parser."""
    from loongsage_plugin_agents.tool_parser import ToolCallParser
    from loongsage_plugin_torch.engine.engine import EmbeddedEngine
    from transformers import AutoTokenizer

    from loongsage_core.agentflow import AgentFlowRouter
    from loongsage_core.config import structure_job
    from loongsage_hookspecs import EngineContext

    job = structure_job({"model": {"path": str(MODEL)},
                         "rollout": {"max_context_length": CONTEXT, "engine_args": ENGINE_ARGS}})
    engine = EmbeddedEngine(EngineContext(job=job, components=None))
    url = engine.start()
    router = AgentFlowRouter(AutoTokenizer.from_pretrained(str(MODEL)), [url], [ToolCallParser(format="hermes")])
    router.start()
    try:
        yield router
    finally:
        router.shutdown()
        engine.shutdown()


def hanging_cli(tmp_path: Path) -> tuple[Path, Path]:
    """An executable that prints a version (validate's trial) but otherwise starts a detached
    grandchild (in its own session) and never returns."""
    pids = tmp_path / "pids"
    script = tmp_path / "hang-cli"
    script.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && echo 0.0.1 && exit 0\n"
                      f"setsid sleep 600 & echo $! >> {pids}\necho $$ >> {pids}\nexec sleep 600\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script, pids


def toml_inline(table: dict[str, Any]) -> str:
    """A TOML inline table (JSON values are valid TOML values for strings, numbers and lists)."""
    return "{ " + ", ".join(f"{key} = {json.dumps(value)}" for key, value in table.items()) + " }"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_cli(router: Any, agent: Any, name: str, tid: str) -> tuple[Trajectory, list[dict[str, Any]]]:
    """One trajectory of CLI ``name``; the trajectory and the router's access-log lines for it."""
    started = len(router.access_log.entries())
    traj = Trajectory(id=tid, prompt_id="p0", group_id="g0", prompt=PROMPT, label="Done.")
    traj = asyncio.run(run_agent_trajectory(router, agent, None,
                                            trajectory=traj, sampling={"max_new_tokens": 96, "temperature": 0.0},
                                            timeout_s=660))
    calls = [e for e in router.access_log.entries()[started:] if e["path"].startswith(f"/{tid}/")]
    return traj, calls


@pytest.mark.parametrize("name", ["codex", "claude_code", "opencode"])
def test_cli_finishes_and_every_request_is_served(served, agents, name):
    traj, calls = run_cli(served, agents(name, {**CLI_ARGS[name], "timeout_s": 600}), name, f"cli-run-{name}")
    assert traj.status == TrajectoryStatus.COMPLETED, traj.error
    assert calls and all(e["status"] < 400 for e in calls), calls
    assert traj.metadata["agentflow"]["turns"] >= 1
    generated = sum(s.num_generated for s in traj.segments)
    assert traj.segments and generated > 0  # the trajectory is recorded token by token
    assert traj.metadata["prefix_cache"]["prompt_tokens"] > 8000  # the CLI's real prompt
    assert traj.metadata["agentflow"]["agent"]["exit_code"] == 0


@pytest.mark.parametrize("name", ["codex", "claude_code", "opencode"])
def test_cli_does_a_tool_round_trip_through_the_router(served, agents, name):
    tid = f"cli-{name}"
    traj, calls = run_cli(served, agents(name, {**CLI_ARGS[name], "timeout_s": 600}), name, tid)
    assert traj.status == TrajectoryStatus.COMPLETED, traj.error
    # every request the CLI made was served, and it made two model calls: the tool call, then the answer
    assert calls and all(e["status"] < 400 for e in calls), calls
    meta = traj.metadata["agentflow"]
    assert meta["turns"] == 2
    assert traj.response_text == "Done."
    # the recorded trajectory: the tool call and the answer are the generated tokens, the tool
    # result came back from the CLI (mask 0) before the answer
    assert any(m.get("role") == "tool" for m in traj.messages)
    generated = sum(s.num_generated for s in traj.segments)
    assert traj.segments and generated > 10
    prompt_tokens = traj.metadata["prefix_cache"]["prompt_tokens"]
    assert prompt_tokens > 2 * 8000  # two turns of the CLI's real prompt
    # the second turn reused the first turn's KV: most of its prompt came from the prefix cache
    assert traj.metadata["prefix_cache"]["cached_tokens"] > 0.4 * prompt_tokens
    if name == "opencode":  # OpenCode's tool is called bash: it ran the command in the working directory
        assert meta["agent"]["changed_files"] == {"hello.txt": "hello\n"}


def test_a_hanging_cli_is_killed_at_its_timeout_and_its_trajectory_fails(served, agents, tmp_path):
    script, pids = hanging_cli(tmp_path)
    traj = Trajectory(id="cli-hang", prompt_id="p0", group_id="g0", prompt=PROMPT)
    t0 = time.monotonic()
    traj = asyncio.run(run_agent_trajectory(served, agents("codex", {"binary": str(script), "timeout_s": 3}), None,
                                            trajectory=traj, sampling={"max_new_tokens": 8}, timeout_s=120))
    assert time.monotonic() - t0 < 60
    assert traj.status == TrajectoryStatus.FAILED
    assert "did not finish within 3s" in traj.error
    deadline = time.monotonic() + 10
    recorded = [int(p) for p in pids.read_text().split()]
    while any(alive(p) for p in recorded) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in recorded), "the CLI's process tree outlived its timeout"


def test_a_missing_cli_is_a_validate_error(tmp_path):
    from loongsage_core.config import ConfigError, load_job
    from loongsage_core.resolve import resolve_job

    job = tmp_path / "job.toml"
    job.write_text(f"""
[plugins]
enable = ["torch", "rl", "rewards", "loggers", "agents"]
[model]
path = "{MODEL}"
[[data]]
name = "cli"
generator = "arithmetic"
agent = "claude_code"
agent_args = {{ binary = "{tmp_path / 'no-such-claude'}" }}
reward = ["exact_match"]
""")
    with pytest.raises(ConfigError) as err:
        resolve_job(load_job(job))
    message = str(err.value)
    assert "data[0].agent_args" in message and "scripts/install_agent_clis.sh" in message
    assert "\n" not in message


def test_a_cli_that_cannot_start_in_the_sources_sandbox_is_a_validate_error(tmp_path):
    """validate starts the CLI where its trajectories will (the source's local sandbox): one that
    cannot start there is a one-line error naming the source, not a run of failed trajectories."""
    from loongsage_core.config import ConfigError, load_job
    from loongsage_core.resolve import resolve_job

    job = tmp_path / "job.toml"
    body = f"""
[plugins]
enable = ["torch", "rl", "rewards", "loggers", "agents"]
[model]
path = "{MODEL}"
[[data]]
name = "cli"
generator = "arithmetic"
agent = "opencode"
sandbox = "local"
sandbox_args = {{ memory_mb = MEMORY }}
reward = ["exact_match"]
"""
    job.write_text(body.replace("MEMORY", "0"))  # node reserves much address space: no limit
    resolve_job(load_job(job))
    job.write_text(body.replace("MEMORY", "16"))
    with pytest.raises(ConfigError) as err:
        resolve_job(load_job(job))
    message = str(err.value)
    assert "data[0].agent: the opencode agent's CLI does not start in the data source's local sandbox" in message
    assert "\n" not in message


def test_a_training_step_with_each_cli_as_the_agent(ray_cluster, tmp_path):
    """A GRPO step with Codex and Claude Code as agents, beside a source whose CLI hangs (OpenCode
    trains in the ``opencode`` recipe's run, tests/test_swe_recipe.py: its 20K-token prompt makes
    each of its trajectories cost seconds of training on 2 cores). One step: each trajectory of a
    CLI costs seconds of training on 2 cores, and a second step would exercise nothing new."""
    from loongsage_core.config import load_job
    from loongsage_core.controller.run import run_job
    from loongsage_core.resolve import resolve_job

    script, _ = hanging_cli(tmp_path)
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"prompt": PROMPT, "label": "Done."}) + "\n" for _ in range(4)))
    access = tmp_path / "access.jsonl"
    # a step quota of 3 prompts: one each for Codex, Claude Code and the hanging CLI
    sources = [(name, 1 / 3, {**CLI_ARGS[name], "timeout_s": 600}) for name in ("codex", "claude_code")]
    sources.append(("codex", 1 / 3, {"binary": str(script), "timeout_s": 3}))
    tables = "".join(f"""
[[data]]
name = "src{i}_{name}"
weight = {weight}
path = "{data}"
agent = "{name}"
agent_args = {toml_inline(args)}
reward = ["exact_match"]
""" for i, (name, weight, args) in enumerate(sources))
    job = tmp_path / "job.toml"
    job.write_text(f"""
[plugins]
enable = ["torch", "rl", "rewards", "loggers", "agents"]
[model]
path = "{MODEL}"
[train]
lr = 1e-4
total_steps = 1
mini_batch_size = 6
micro_batch_size = 1
[rollout]
prompts_per_step = 3
samples_per_prompt = 2
max_new_tokens = 96
temperature = 0.0
max_context_length = {CONTEXT}
weight_transport = "inprocess"
engine_args = {toml_inline(ENGINE_ARGS)}
[agentflow]
middleware = ["tool_call_parser"]
middleware_args = {{ tool_call_parser = {{ format = "hermes" }} }}
agent_timeout_s = 660
access_log = "{access}"
{tables}
[[loggers]]
name = "jsonl"
""")
    history = run_job(resolve_job(load_job(job)), output_dir=str(tmp_path / "run"))
    assert len(history) == 1
    per_source: dict[str, float] = {}
    for m in history:
        assert m["rollout/num_trajectories"] == 6.0
        for key, value in m.items():
            if key.startswith("rollout_per_source/") and key.endswith("/count"):
                per_source[key.split("/")[1]] = per_source.get(key.split("/")[1], 0.0) + value
    # both real CLIs ran in the step (quota mixing); only the hanging CLI's trajectories failed
    assert sorted(per_source) == ["src0_codex", "src1_claude_code"]
    assert [m["rollout/failed_ratio"] for m in history] == [pytest.approx(1 / 3)]
    assert all(m["rollout/prefix_cache_hit_ratio"] > 0.0 for m in history)  # the group's samples share a prefix
    entries = [json.loads(line) for line in access.read_text().splitlines()]
    assert entries and all(e["status"] < 400 for e in entries), [e for e in entries if e["status"] >= 400]
