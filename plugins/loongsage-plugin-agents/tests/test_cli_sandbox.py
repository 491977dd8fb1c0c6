"""CLI agents in the ``local`` sandbox wherever the CLI is installed, and the validate-time trial.

Bubblewrap gives a sandbox a private ``/tmp``: a CLI installed under ``/tmp`` (a checkout there,
pytest's own ``tmp_path``) used to be missing inside it, so every trajectory failed with exit
status 127. The CLI here is a real node program in an npm-shaped install under ``tmp_path`` (its
``.bin`` link, its package and a module it requires), run by the real sandbox.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
from loongsage_plugin_agents.cli_agents import ClaudeCodeAgent
from loongsage_plugin_agents.cli_preflight import preflight_cli
from loongsage_plugin_agents.local_sandbox import LocalSandboxProvider
from loongsage_plugin_agents.sandbox_isolation import bwrap_problem
from loongsage_plugin_agents.sandbox_mounts import program_paths, tool_paths

from loongsage_hookspecs import AgentContext

NODE = shutil.which("node") or "node is installed by scripts/setup.sh with the agent CLIs"


def npm_install(prefix: Path) -> str:
    """A node CLI ``claude`` installed npm's way under ``prefix``: ``node_modules/.bin/claude`` links
    to the package's script, which requires a module of its package and answers like Claude Code."""
    package = prefix / "node_modules" / "fake-claude"
    (package / "lib").mkdir(parents=True)
    (package / "lib" / "answer.js").write_text(
        'module.exports = () => JSON.stringify({type: "result", is_error: false, result: "ok from " + '
        'process.getuid()});\n')
    script = package / "bin" / "cli.js"
    script.parent.mkdir()
    script.write_text('#!/usr/bin/env node\nif (process.argv.includes("--version")) { console.log("9.9.9"); '
                      'process.exit(0); }\nconsole.log(require("../lib/answer.js")());\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC | stat.S_IXGRP | stat.S_IXOTH)
    bin_dir = prefix / "node_modules" / ".bin"
    bin_dir.mkdir()
    (bin_dir / "claude").symlink_to(os.path.relpath(script, bin_dir))
    for path in [prefix, *prefix.parents]:  # the sandbox's own user must reach it, as a real checkout
        if str(path) in ("/", "/tmp"):
            break
        path.chmod(path.stat().st_mode | 0o055)
    return str(bin_dir / "claude")


def test_tool_paths_name_the_whole_install_and_node(tmp_path):
    cli = npm_install(tmp_path / "checkout" / ".tools" / "npm")
    paths = tool_paths(cli)
    assert str(tmp_path / "checkout" / ".tools" / "npm") in paths
    assert os.path.dirname(os.path.realpath(NODE)) in paths
    venv_python = tmp_path / "venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    (tmp_path / "venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    venv_python.symlink_to(os.path.realpath(shutil.which("python3") or "/usr/bin/python3"))
    script = tmp_path / "agent.py"
    script.write_text("print(1)\n")
    paths = program_paths([str(venv_python), str(script), "relative.py", "/no/such/file"])
    assert str(tmp_path / "venv") in paths and str(script) in paths and "/no/such/file" not in paths
    lib = tmp_path / "lib"  # a PYTHONPATH entry: the program imports from it
    lib.mkdir()
    paths = program_paths(["python3"], python_path=os.pathsep.join([str(lib), "relative", "/no/such/dir"]))
    assert str(lib) in paths and "relative" not in paths and "/no/such/dir" not in paths


def test_a_cli_installed_under_tmp_runs_in_a_bubblewrap_sandbox(tmp_path):
    """The CLI's install lives under /tmp, which bubblewrap replaces with a private one: the
    sandbox mounts the install (and node) read-only where they are, and the CLI runs."""
    assert str(tmp_path).startswith("/tmp/")
    cli = npm_install(tmp_path / "checkout" / ".tools" / "npm")
    root = tempfile.mkdtemp(prefix="lsb-")  # short: the router bridge is a Unix socket under it
    os.chmod(root, 0o711)

    async def run() -> tuple[str, dict]:
        provider = LocalSandboxProvider(root=root, isolation="bwrap")
        box = await provider.create("cli-under-tmp")
        try:
            agent = ClaudeCodeAgent(binary=cli, timeout_s=60)
            result = await agent.run(AgentContext(trajectory_id="cli-under-tmp", prompt="hi", sandbox=box,
                                                  base_url="http://127.0.0.1:18123/cli-under-tmp/0/v1", api_key="k"))
            return result.response_text, result.metadata
        finally:
            await provider.destroy(box)
            await provider.close()

    try:
        text, meta = asyncio.run(run())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert text.startswith("ok from ") and meta["sandboxed"] and meta["exit_code"] == 0
    if os.geteuid() == 0:  # as the sandbox's own user, not root
        assert text != "ok from 0"


def test_the_preflight_starts_the_cli_where_its_trajectories_run(tmp_path):
    """validate's trial: the CLI prints its version in the data source's sandbox, or on the host
    without one; a sandbox the CLI cannot start in (here: too little address space for node) is a
    one-line error that says where."""
    cli = npm_install(tmp_path / "checkout" / ".tools" / "npm")
    preflight_cli(ClaudeCodeAgent, {"binary": cli}, "local", {})
    preflight_cli(ClaudeCodeAgent, {"binary": cli}, None, {})
    preflight_cli(ClaudeCodeAgent, {"binary": cli}, None, {"memory_mb": 16})  # no sandbox: its limits do not apply
    with pytest.raises(ValueError) as info:
        preflight_cli(ClaudeCodeAgent, {"binary": cli}, "local", {"memory_mb": 16})
    message = str(info.value)
    assert "claude_code agent's CLI does not start in the data source's local sandbox" in message, message
    assert "--version" in message and "\n" not in message
    broken = tmp_path / "broken"
    broken.write_text("#!/bin/sh\necho 'cannot load the platform binary' >&2\nexit 3\n")
    broken.chmod(0o755)
    with pytest.raises(ValueError, match="does not start on this machine.*exit status 3: cannot load"):
        preflight_cli(ClaudeCodeAgent, {"binary": str(broken)}, None, {})


def test_the_fallback_warning_names_why_bubblewrap_is_not_used(tmp_path, monkeypatch):
    """bubblewrap installed but failing (a container without user namespaces) is said so, with its
    error, not called "not available"; not installed is said so too."""
    fake = tmp_path / "bin" / "bwrap"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    problem = bwrap_problem()
    assert problem is not None and problem.startswith(f"bubblewrap ({fake}) is installed but does not work here")
    assert problem.endswith("exit status 1: bwrap: No permissions to create new namespace")
    provider = LocalSandboxProvider(root=str(tmp_path / "boxes"), run_as_user=None)
    assert provider.isolation != "bwrap"
    assert provider.warnings[0].startswith(problem + "; running with the weaker isolation")
    assert json.dumps(provider.enforced)  # recorded in every trajectory's metadata
    monkeypatch.setenv("PATH", "/nonexistent")
    assert bwrap_problem() == "bubblewrap is not installed (apt-get install -y bubblewrap)"
