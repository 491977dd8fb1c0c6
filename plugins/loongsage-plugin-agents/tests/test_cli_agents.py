"""The CLI agents' own parts: the config each writes, how each reads the answer, the runner's
file diff, process-tree kill and CLI lookup. (The CLIs against the real router: tests/test_agent_clis.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest
from loongsage_plugin_agents.cli_agents import ClaudeCodeAgent, CodexAgent, OpenCodeAgent
from loongsage_plugin_agents.cli_runner import (
    CliAgentError,
    CliNotFoundError,
    changed_files,
    check_cli_args,
    find_cli,
    prompt_text,
    snapshot,
)

from loongsage_hookspecs import AgentContext

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

BASE = "http://127.0.0.1:9/traj-1/0/v1"


def fake_cli(tmp_path: Path, body: str) -> str:
    path = tmp_path / "fake-cli"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def ctx(**kw) -> AgentContext:
    return AgentContext(trajectory_id="traj-1", base_url=BASE, api_key="k", prompt="Say hi.", **kw)


def test_codex_config_points_a_responses_provider_at_the_trajectory(tmp_path):
    agent = CodexAgent(binary=fake_cli(tmp_path, "exit 0"), context_window=4096)
    env = agent.configure(str(tmp_path), ctx(), str(tmp_path / "work"))
    config = tomllib.loads((Path(env["CODEX_HOME"]) / "config.toml").read_text())
    provider = config["model_providers"][config["model_provider"]]
    assert provider["base_url"] == BASE and provider["wire_api"] == "responses"
    assert env[provider["env_key"]] == "k" and provider["request_max_retries"] == 0
    assert config["model_context_window"] == 4096 and config["approval_policy"] == "never"
    assert config["check_for_update_on_startup"] is False and config["analytics"]["enabled"] is False
    argv = agent.command("Say hi.", str(tmp_path), "/w")
    assert argv[0] == "exec" and argv[-1] == "Say hi." and "--skip-git-repo-check" in argv
    (tmp_path / "last_message.txt").write_text("hello\n")
    assert agent.answer("", "", str(tmp_path)) == "hello"


def test_claude_code_env_points_at_the_base_without_v1_and_turns_traffic_off(tmp_path):
    agent = ClaudeCodeAgent(binary=fake_cli(tmp_path, "exit 0"), model="m")
    env = agent.configure(str(tmp_path), ctx(), str(tmp_path))
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9/traj-1/0" and env["ANTHROPIC_API_KEY"] == "k"
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_SMALL_FAST_MODEL"] == "m"
    for key in ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "DISABLE_TELEMETRY", "DISABLE_AUTOUPDATER",
                "DISABLE_ERROR_REPORTING"):
        assert env[key] == "1"
    out = json.dumps({"type": "result", "subtype": "success", "is_error": False, "result": " 4 "})
    assert agent.answer(out, "", str(tmp_path)) == "4"
    with pytest.raises(CliAgentError, match="reported an error"):
        agent.answer(json.dumps({"type": "result", "is_error": True, "result": "API Error: 400"}), "", "")
    with pytest.raises(CliAgentError, match="no result"):
        agent.answer("not json", "boom", "")


def test_opencode_config_is_an_openai_compatible_provider_and_its_answer_is_the_last_step(tmp_path):
    agent = OpenCodeAgent(binary=fake_cli(tmp_path, "exit 0"), context_window=2048, max_output_tokens=64)
    env = agent.configure(str(tmp_path), ctx(), str(tmp_path))
    config = json.loads(Path(env["OPENCODE_CONFIG"]).read_text())
    provider = config["provider"]["loongsage"]
    assert provider["npm"] == "@ai-sdk/openai-compatible" and provider["options"]["baseURL"] == BASE
    assert provider["models"]["policy"]["limit"] == {"context": 2048, "output": 64}
    assert config["model"] == "loongsage/policy" and config["autoupdate"] is False
    assert env["OPENCODE_DISABLE_AUTOUPDATE"] == env["OPENCODE_DISABLE_MODELS_FETCH"] == "1"
    events = [{"type": "step_start", "part": {}}, {"type": "text", "part": {"text": "calling"}},
              {"type": "tool_use", "part": {"tool": "bash"}}, {"type": "step_start", "part": {}},
              {"type": "text", "part": {"text": "Do"}}, {"type": "text", "part": {"text": "ne."}}]
    assert agent.answer("\n".join(json.dumps(e) for e in events), "", "") == "Done."
    with pytest.raises(CliAgentError, match="reported an error"):
        agent.answer(json.dumps({"type": "error", "error": {"name": "APIError"}}), "", "")


def test_opencode_config_argument_is_deep_merged_and_a_bad_key_is_a_clear_error(tmp_path):
    short = {"agent": {"build": {"prompt": "Write files.", "tools": {"*": False, "write": True}}},
             "permission": {"bash": "deny"}, "provider": {"loongsage": {"options": {"timeout": 5}}}}
    agent = OpenCodeAgent(binary=fake_cli(tmp_path, "exit 0"), config=short)
    config = json.loads(Path(agent.configure(str(tmp_path), ctx(), str(tmp_path))["OPENCODE_CONFIG"]).read_text())
    assert config["agent"] == short["agent"]
    # merged key by key: the agent's other permissions and provider options stay
    assert config["permission"] == {"edit": "allow", "bash": "deny", "webfetch": "deny"}
    assert config["provider"]["loongsage"]["options"] == {"baseURL": BASE, "apiKey": "k", "maxRetries": 0,
                                                          "timeout": 5}
    assert config["provider"]["loongsage"]["npm"] == "@ai-sdk/openai-compatible"
    with pytest.raises(ValueError, match=r"agent_args.config.agnet is not an OpenCode config key"):
        OpenCodeAgent(binary=fake_cli(tmp_path, "exit 0"), config={"agnet": {}})
    with pytest.raises(ValueError, match=r"agent_args.config.provider.loongsage.options.baseURL is the trajectory"):
        OpenCodeAgent(binary=fake_cli(tmp_path, "exit 0"),
                      config={"provider": {"loongsage": {"options": {"baseURL": "http://elsewhere/v1"}}}})
    with pytest.raises(ValueError, match="agent_args.config must be a table"):
        OpenCodeAgent(binary=fake_cli(tmp_path, "exit 0"), config=["agent"])
    with pytest.raises(ValueError, match="agent_args.config.tools must be a table"):  # what validate checks too
        check_cli_args(OpenCodeAgent, {"binary": fake_cli(tmp_path, "exit 0"), "config": {"tools": "write"}})


def test_a_run_hands_the_answer_and_changed_files_to_the_reward(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("same")
    (work / "gone.txt").write_text("bye")
    script = fake_cli(tmp_path, 'echo "$HOME" > home.txt; rm gone.txt; echo edited >> keep.txt\n'
                                'printf \'{"type":"result","is_error":false,"result":"ok"}\'\n')
    agent = ClaudeCodeAgent(binary=script, cwd=str(work))
    result = asyncio.run(agent.run(ctx()))
    assert result.response_text == "ok" and result.metadata["exit_code"] == 0
    changed = result.metadata["changed_files"]
    home = changed.pop("home.txt").strip()
    assert changed == {"keep.txt": "sameedited\n", "gone.txt": None}
    assert "loongsage-claude-home-" in home and not os.path.exists(home)  # the throwaway home is gone


def test_a_failing_cli_raises_with_its_stderr(tmp_path):
    agent = CodexAgent(binary=fake_cli(tmp_path, "echo 'no provider' >&2; exit 3"))
    with pytest.raises(CliAgentError, match="exited with status 3: no provider"):
        asyncio.run(agent.run(ctx()))


def test_timeout_kills_the_whole_process_tree(tmp_path):
    pids = tmp_path / "pids"
    script = fake_cli(tmp_path, f"setsid sleep 300 & echo $! >> {pids}\nsleep 300 & echo $! >> {pids}\nwait\n")
    agent = OpenCodeAgent(binary=script, timeout_s=1)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 1s"):
        asyncio.run(agent.run(ctx()))
    assert time.monotonic() - t0 < 30
    time.sleep(0.5)
    for pid in map(int, pids.read_text().split()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().rsplit(")", 1)[1].split()[0] == "Z", f"process {pid} survived"
        except FileNotFoundError:
            pass


def test_prompt_text_and_snapshots(tmp_path):
    assert prompt_text("x") == "x"
    assert prompt_text([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) == "u"
    assert prompt_text([{"role": "user", "content": [{"type": "text", "text": "a"}]}]) == "a"
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("x")
    (tmp_path / "a.txt").write_text("1")
    before = snapshot(str(tmp_path))
    assert list(before) == ["a.txt"]
    (tmp_path / "b.txt").write_text("2")
    assert changed_files(str(tmp_path), before) == {"b.txt": "2"}


def test_a_missing_cli_names_the_install_command(tmp_path):
    with pytest.raises(CliNotFoundError, match="scripts/install_agent_clis.sh"):
        find_cli("loongsage-no-such-cli", "no-such-package")
    with pytest.raises(ValueError, match="is not an executable file"):
        find_cli("codex", "@openai/codex", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="unknown argument"):
        check_cli_args(CodexAgent, {"binary": fake_cli(tmp_path, "exit 0"), "modle": "x"})
    check_cli_args(CodexAgent, {"binary": fake_cli(tmp_path, "exit 0"), "sandbox": "read-only", "args": ["-c", "x=1"]})
