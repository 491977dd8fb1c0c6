"""The ``command`` agent: any program that speaks OpenAI, run as a black box.

The program gets the trajectory's endpoint the way OpenAI tools expect it and the prompt three
ways, so it needs no changes to be trained:

* environment: ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``LOONGSAGE_PROMPT`` (the prompt text,
  or JSON for a list of messages), ``LOONGSAGE_PROMPT_FILE`` (a JSON file
  ``{"trajectory_id", "prompt", "metadata"}``), ``LOONGSAGE_RESULT_FILE``, ``LOONGSAGE_TRAJECTORY_ID``;
* standard input: the prompt text (or JSON), unless ``stdin=false``;
* ``{prompt_file}`` / ``{workdir}`` placeholders in the command line.

The response (for the reward) is the text the program wrote to ``LOONGSAGE_RESULT_FILE`` if it
wrote one, else its standard output (stripped). A non-zero exit status or a timeout raises, so
the host marks the trajectory failed; on timeout or cancellation the program's whole process
group is killed.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import signal
import tempfile

from loongsage_hookspecs import AgentContext, AgentResult


class CommandAgentError(RuntimeError):
    """The program exited with a non-zero status (the message has the tail of its stderr)."""


class CommandAgent:
    """Runs ``command`` once per trajectory (see the module docstring).

    Args:
        command: the program and its arguments (a list, or a string split like a shell would).
        timeout_s: wall-clock limit (default: the trajectory's timeout, else 600 s).
        stdin: also send the prompt on standard input.
        env: extra environment variables.
        inherit_env: start from the host's environment (``PATH``, ...) rather than an empty one.
        cwd: working directory (default: the sandbox directory if there is one, else a fresh
            temporary directory removed afterwards).
        max_output_bytes: standard output/error kept.
    """

    def __init__(self, command: str | list[str], timeout_s: float | None = None, stdin: bool = True,
                 env: dict[str, str] | None = None, inherit_env: bool = True, cwd: str | None = None,
                 max_output_bytes: int = 4_000_000) -> None:
        argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
        if not argv:
            raise ValueError("command agent: 'command' is empty")
        self.argv = argv
        self.timeout_s = timeout_s
        self.stdin = stdin
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.inherit_env = inherit_env
        self.cwd = cwd
        self.max_output_bytes = max_output_bytes

    async def run(self, ctx: AgentContext) -> AgentResult:
        prompt_text = ctx.prompt if isinstance(ctx.prompt, str) else json.dumps(ctx.prompt, ensure_ascii=False)
        scratch = tempfile.mkdtemp(prefix="loongsage-command-")
        try:
            workdir = self.cwd or (ctx.sandbox.workdir if ctx.sandbox is not None else scratch)
            prompt_file = os.path.join(scratch, "prompt.json")
            result_file = os.path.join(scratch, "result.txt")
            with open(prompt_file, "w", encoding="utf-8") as f:
                json.dump({"trajectory_id": ctx.trajectory_id, "prompt": ctx.prompt, "metadata": ctx.metadata}, f,
                          ensure_ascii=False, default=str)
            env = dict(os.environ) if self.inherit_env else {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
            env.update({"OPENAI_BASE_URL": ctx.base_url, "OPENAI_API_KEY": ctx.api_key or "loongsage",
                        "LOONGSAGE_PROMPT": prompt_text, "LOONGSAGE_PROMPT_FILE": prompt_file,
                        "LOONGSAGE_RESULT_FILE": result_file, "LOONGSAGE_TRAJECTORY_ID": ctx.trajectory_id})
            env.update(self.env)
            argv = [a.replace("{prompt_file}", prompt_file).replace("{workdir}", workdir) for a in self.argv]
            timeout = self.timeout_s or ctx.timeout_s or 600.0
            out, err, code = await self._run(argv, env, workdir, prompt_text, timeout)
            if code != 0:
                tail = err.decode(errors="replace")[-2000:]
                raise CommandAgentError(f"command agent: {argv[0]} exited with status {code}: {tail}")
            if os.path.exists(result_file):
                with open(result_file, encoding="utf-8", errors="replace") as f:
                    response = f.read().strip()
            else:
                response = out.decode(errors="replace").strip()
            return AgentResult(response_text=response, metadata={"exit_code": code})
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    async def _run(self, argv: list[str], env: dict[str, str], cwd: str, prompt: str,
                   timeout: float) -> tuple[bytes, bytes, int]:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, cwd=cwd, env=env, start_new_session=True,
                stdin=asyncio.subprocess.PIPE if self.stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        except OSError as exc:
            raise CommandAgentError(f"command agent: cannot start {argv[0]!r}: {exc}") from exc
        try:
            out, err = await asyncio.wait_for(proc.communicate(prompt.encode() if self.stdin else None), timeout)
        except asyncio.TimeoutError:
            _kill(proc)
            await proc.wait()
            raise TimeoutError(f"command agent: {argv[0]} did not finish within {timeout:g}s") from None
        except BaseException:  # cancelled by the host (trajectory timeout, shutdown)
            _kill(proc)
            await _reap(proc)
            raise
        return out[-self.max_output_bytes:], err[-self.max_output_bytes:], proc.returncode or 0


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Wait for a killed process so its pipes close on this event loop (also when cancelled)."""
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), 5)
    except (asyncio.CancelledError, asyncio.TimeoutError):
        pass


def _kill(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
