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
tree is killed.

With a sandbox (the data source sets ``sandbox = "local"``), the program runs *inside* it, like
every command there: in its working directory, as its unprivileged user, under its isolation and
limits, with only the variables above and ``env`` in its environment (the host's never enter;
``inherit_env`` and ``cwd`` do not apply), the prompt and result files in the sandbox's home, and
``OPENAI_BASE_URL`` leading to the router only (see :meth:`LocalSandbox.bridge`). The program
must be executable by the sandbox's user (not under a private home such as ``/root``).
Without a sandbox it runs on the host, in a temporary directory, with ``PATH`` and the locale
of the host's environment only (unless ``inherit_env``).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tempfile
import uuid
from typing import Any

from loongsage_hookspecs import AgentContext, AgentResult, RunsPrograms

from .sandbox_mounts import program_paths
from .sandbox_procs import Launch, await_launch


class CommandAgentError(RuntimeError):
    """The program exited with a non-zero status (the message has the tail of its stderr)."""


class CommandAgent:
    """Runs ``command`` once per trajectory (see the module docstring).

    Args:
        command: the program and its arguments (a list, or a string split like a shell would).
        timeout_s: wall-clock limit (default: the trajectory's timeout, else 600 s).
        stdin: also send the prompt on standard input.
        env: extra environment variables.
        inherit_env: without a sandbox, start from the host's whole environment rather than
            ``PATH`` and the locale.
        cwd: working directory (default: the sandbox directory if there is one, else a fresh
            temporary directory removed afterwards).
        max_output_bytes: standard output/error kept.
    """

    def __init__(self, command: str | list[str], timeout_s: float | None = None, stdin: bool = True,
                 env: dict[str, str] | None = None, inherit_env: bool = False, cwd: str | None = None,
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

    def _argv(self, prompt_file: str, workdir: str) -> list[str]:
        return [a.replace("{prompt_file}", prompt_file).replace("{workdir}", workdir) for a in self.argv]

    def _endpoint_env(self, ctx: AgentContext, base_url: str, prompt_text: str, prompt_file: str,
                      result_file: str) -> dict[str, str]:
        return {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": ctx.api_key or "loongsage",
                "LOONGSAGE_PROMPT": prompt_text, "LOONGSAGE_PROMPT_FILE": prompt_file,
                "LOONGSAGE_RESULT_FILE": result_file, "LOONGSAGE_TRAJECTORY_ID": ctx.trajectory_id, **self.env}

    async def run(self, ctx: AgentContext) -> AgentResult:
        prompt_text = ctx.prompt if isinstance(ctx.prompt, str) else json.dumps(ctx.prompt, ensure_ascii=False)
        if isinstance(ctx.sandbox, RunsPrograms):
            return await self._run_in_sandbox(ctx, ctx.sandbox, prompt_text)
        scratch = tempfile.mkdtemp(prefix="loongsage-command-")
        try:
            workdir = self.cwd or (ctx.sandbox.workdir if ctx.sandbox is not None else scratch)
            prompt_file = os.path.join(scratch, "prompt.json")
            result_file = os.path.join(scratch, "result.txt")
            with open(prompt_file, "w", encoding="utf-8") as f:
                json.dump({"trajectory_id": ctx.trajectory_id, "prompt": ctx.prompt, "metadata": ctx.metadata}, f,
                          ensure_ascii=False, default=str)
            env = dict(os.environ) if self.inherit_env else {
                k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TZ")}
            env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
            env.update(self._endpoint_env(ctx, ctx.base_url, prompt_text, prompt_file, result_file))
            argv = self._argv(prompt_file, workdir)
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

    async def _run_in_sandbox(self, ctx: AgentContext, box: Any, prompt_text: str) -> AgentResult:
        """The program inside the trajectory's sandbox (see the module docstring)."""
        base_url, bridge = box.bridge(ctx.base_url)
        prompt_file = box.write_home_file("loongsage/prompt.json", json.dumps(
            {"trajectory_id": ctx.trajectory_id, "prompt": ctx.prompt, "metadata": ctx.metadata},
            ensure_ascii=False, default=str))
        result_file = os.path.join(os.path.dirname(prompt_file), "result.txt")
        argv = self._argv(prompt_file, box.workdir)
        timeout = self.timeout_s or ctx.timeout_s or 600.0
        env = self._endpoint_env(ctx, base_url, prompt_text, prompt_file, result_file)
        done = await box.arun_program(argv, env=env, stdin=prompt_text.encode() if self.stdin else None,
                                      timeout_s=timeout, bridge=bridge, max_output_bytes=self.max_output_bytes,
                                      budgeted=True,
                                      read_only=program_paths(argv, python_path=self.env.get("PYTHONPATH")))
        if done.timed_out:
            raise TimeoutError(f"command agent: {argv[0]} did not finish within {timeout:g}s (or the trajectory's "
                               "sandbox time budget); its process tree was killed")
        if done.exit_code != 0:
            tail = done.stderr.decode(errors="replace")[-2000:]
            raise CommandAgentError(f"command agent: {argv[0]} exited with status {done.exit_code} in the sandbox: "
                                    f"{tail}")
        if os.path.exists(result_file):
            with open(result_file, encoding="utf-8", errors="replace") as f:
                response = f.read(self.max_output_bytes).strip()
        else:
            response = done.stdout.decode(errors="replace").strip()
        return AgentResult(response_text=response, metadata={"exit_code": done.exit_code, "sandboxed": True,
                                                            "output_truncated": done.truncated})

    async def _run(self, argv: list[str], env: dict[str, str], cwd: str, prompt: str,
                   timeout: float) -> tuple[bytes, bytes, int]:
        """The program on the host: its output capped while read, its whole tree killed at the
        timeout or when the host cancels the trajectory."""
        marker = f"command-agent/{uuid.uuid4().hex}"

        def start() -> Launch:
            try:
                return Launch(argv, env=env, cwd=cwd, marker=marker, stdin=prompt.encode() if self.stdin else None,
                              max_output_bytes=self.max_output_bytes, user_kwargs={})
            except OSError as exc:
                raise CommandAgentError(f"command agent: cannot start {argv[0]!r}: {exc}") from exc

        done = await await_launch(start, timeout, name="command-agent")
        if done.timed_out:
            raise TimeoutError(f"command agent: {argv[0]} did not finish within {timeout:g}s")
        return done.stdout, done.stderr, done.exit_code
