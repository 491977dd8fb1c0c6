"""The validate-time trial of a CLI agent: the CLI starts where its trajectories will run it.

``loongsage validate`` (and every run, before anything starts) calls the agent spec's
``preflight``: the CLI prints its version (``<cli> --version``) with the environment the agent
gives it, inside a sandbox of the data source's ``local`` sandbox settings when it has one (a
fresh provider under a temporary root, so nothing of another run's sandboxes is touched), else on
the host. A CLI that cannot start there (not mounted in the sandbox, not readable by the
sandbox's user, killed by its limits) is then a one-line configuration error instead of every
trajectory failing with exit status 127.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import subprocess
import tempfile
from typing import Any, Mapping

from .cli_runner import CliAgent
from .sandbox_errors import SandboxError
from .sandbox_mounts import tool_paths

PREFLIGHT_TIMEOUT_S = 60.0
# sandbox arguments the trial leaves out: where sandboxes live and what prepares their contents
_NOT_FOR_TRIAL = frozenset({"root", "base_dir", "max_concurrent_sandboxes", "setup_timeout_s", "setup_network",
                            "trajectory_timeout_s"})


def _tail(out: bytes, err: bytes) -> str:
    lines = (err or out).decode(errors="replace").strip().splitlines()
    return lines[-1][:300] if lines else "no output"


def _on_host(argv: list[str], env: dict[str, str], cwd: str) -> tuple[int | None, str]:
    try:
        done = subprocess.run(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=PREFLIGHT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"did not finish within {PREFLIGHT_TIMEOUT_S:g}s"
    except OSError as exc:
        return 127, str(exc)
    return done.returncode, _tail(done.stdout, done.stderr)


async def _in_local_sandbox(agent: CliAgent, argv: list[str], sandbox_args: Mapping[str, Any],
                            root: str) -> tuple[int | None, str, str]:
    from .local_sandbox import LocalSandboxProvider

    args = {k: v for k, v in sandbox_args.items() if k not in _NOT_FOR_TRIAL}
    provider = LocalSandboxProvider(root=root, **args)
    try:
        box = await provider.create("preflight")
        try:
            env = {k: v for k, v in agent.base_env(box.home).items() if k != "USER"}
            env.update(agent.env)
            done = await box.arun_program(argv, env=env, timeout_s=PREFLIGHT_TIMEOUT_S,
                                          read_only=tool_paths(argv[0], env.get("PATH")))
        finally:
            await provider.destroy(box)
    finally:
        await provider.close()
    if done.timed_out:
        return None, f"did not finish within {PREFLIGHT_TIMEOUT_S:g}s", provider.isolation
    return done.exit_code, _tail(done.stdout, done.stderr), provider.isolation


def preflight_cli(agent_cls: type[CliAgent], agent_args: Mapping[str, Any], sandbox: str | None,
                  sandbox_args: Mapping[str, Any]) -> None:
    """Start the CLI as its trajectories will (see the module docstring); ``ValueError`` with one
    line saying where and why when it does not."""
    agent = agent_cls(**dict(agent_args))
    argv = [agent.executable, "--version"]
    scratch = tempfile.mkdtemp(prefix=f"loongsage-{agent_cls.binary_name}-preflight-")
    try:
        if sandbox == "local":
            os.chmod(scratch, 0o711)  # the sandbox's own user enters it
            with concurrent.futures.ThreadPoolExecutor(1) as pool:  # also when called from an event loop
                try:
                    code, said, isolation = pool.submit(asyncio.run, _in_local_sandbox(agent, argv, sandbox_args,
                                                                                       scratch)).result()
                except SandboxError as exc:
                    raise ValueError(f"the {agent_cls.name} agent's CLI cannot be tried in the data source's "
                                     f"local sandbox: {exc}") from None
            where = f"in the data source's local sandbox (isolation '{isolation}')"
        else:
            code, said = _on_host(argv, {**agent.base_env(scratch), **agent.env}, scratch)
            where = "on this machine"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if code != 0:
        why = said if code is None else f"exit status {code}: {said}"
        raise ValueError(f"the {agent_cls.name} agent's CLI does not start {where}: `{' '.join(argv)}`: {why}")
