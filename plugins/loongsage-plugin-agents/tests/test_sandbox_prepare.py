"""The ``local`` sandbox is prepared from the data row: snapshot (directory, tarball, git bundle +
commit), setup commands and environment; rewards run commands in it synchronously."""

from __future__ import annotations

import asyncio
import os
import subprocess
import tarfile

import pytest
from loongsage_plugin_agents.local_sandbox import LocalSandboxProvider, SandboxError


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def repo(slow_fixture, tmp_path):
    """A small git repository with two commits: v1 (buggy) then v2 (fixed)."""
    path = tmp_path / "calc"
    path.mkdir()
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}

    def git(*args):
        return subprocess.run(["git", *args], cwd=path, env=env, check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    (path / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    git("add", ".")
    git("commit", "-qm", "v1")
    v1 = git("rev-parse", "HEAD")
    (path / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    git("commit", "-qam", "v2")
    bundle = tmp_path / "calc.bundle"
    git("bundle", "create", str(bundle), "--all")
    return path, v1, bundle


def _prepared(provider, row):
    async def scenario():
        box = await provider.create("prep", row)
        try:
            return (box.run("cat calc.py; git log --format=%s 2>/dev/null | head -3; git remote; echo $GREETING"),
                    box.workdir)
        finally:
            await provider.destroy(box)

    return run(scenario())


def test_directory_tarball_and_bundle_snapshots(repo, tmp_path):
    path, v1, bundle = repo
    provider = LocalSandboxProvider(base_dir=str(tmp_path), default_timeout_s=30)
    # a directory as it is (working tree included), by a path relative to base_dir
    res, workdir = _prepared(provider, {"prompt": "p", "metadata": {"sandbox": "calc"}})
    assert "return a + b" in res.stdout and not os.path.exists(workdir)
    # a git bundle at a commit: that commit's files, and no remote to fetch the later history from
    res, _ = _prepared(provider, {"sandbox": {"snapshot": str(bundle), "commit": v1, "env": {"GREETING": "hi"}}})
    lines = res.stdout.splitlines()
    assert lines[:2] == ["def add(a, b):", "    return a - b"] and lines[2] == "v1" and lines[-1] == "hi"
    assert "origin" not in lines
    # a git directory at a commit
    res, _ = _prepared(provider, {"sandbox": {"snapshot": str(path), "commit": v1}})
    assert "return a - b" in res.stdout
    # a tarball with one top-level directory is unpacked without it
    archive = tmp_path / "calc.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(path / "calc.py", arcname="calc-1.0/calc.py")
    res, _ = _prepared(provider, {"sandbox": str(archive)})
    assert res.stdout.startswith("def add(a, b):\n    return a + b")


def test_setup_commands_run_in_the_sandbox_and_a_failing_one_fails_create(repo, tmp_path):
    path, _, _ = repo
    provider = LocalSandboxProvider(default_timeout_s=30)

    async def scenario():
        box = await provider.create("setup", {"sandbox": {"snapshot": str(path), "setup": [
            "echo built > build.txt", "python3 -c \"import os; print(os.getcwd())\" > where.txt"]}})
        try:
            return box.read_file("build.txt"), box.read_file("where.txt").strip(), box.workdir
        finally:
            await provider.destroy(box)

    built, where, workdir = run(scenario())
    assert built == "built\n" and where == workdir
    with pytest.raises(SandboxError, match=r"setup command 'exit 3' exited with status 3"):
        run(provider.create("bad-setup", {"sandbox": {"setup": ["echo ok", "exit 3"]}}))
    with pytest.raises(SandboxError, match="timed out"):
        run(provider.create("slow-setup", {"sandbox": {"setup": "sleep 30", "setup_timeout_s": 0.5}}))
    assert provider.live == 0 and provider._sandboxes == {}
    leftovers = [e for e in os.listdir(provider.root) if e.startswith(provider.registry.prefix())]
    assert leftovers == []


@pytest.mark.parametrize("row, message", [
    ({"sandbox": "does/not/exist"}, "does not exist"),
    ({"sandbox": {"snapshot": "x", "nope": 1}}, "unknown key"),
])
def test_bad_rows_fail_create_with_the_trajectory_named(row, message, tmp_path):
    provider = LocalSandboxProvider(base_dir=str(tmp_path))
    with pytest.raises(SandboxError, match=message) as info:
        run(provider.create("traj-7", row))
    assert "traj-7" in str(info.value)
    assert provider.live == 0
