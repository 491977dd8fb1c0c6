"""The shared runner of black-box agent CLIs (Codex, Claude Code, OpenCode).

Every such CLI is an npm program that reads its endpoint from a config file or the environment
and has a non-interactive mode. :class:`CliAgent` runs one per trajectory:

1. a throwaway ``HOME`` (removed afterwards) into which the subclass writes the CLI's config,
   pointing it at the trajectory's base URL with update checks, telemetry and login flows off, so
   the CLI runs offline and leaves nothing behind;
2. the CLI runs non-interactively on the task prompt in the task's working directory (the
   trajectory's sandbox directory if there is one, else ``cwd``, else a fresh temporary
   directory), standard input closed, the environment built from scratch (``PATH`` and the
   locale from the host, nothing else unless ``inherit_env``); ``args`` are appended to the
   CLI's own command line, so any of its flags can be passed through;
3. past ``timeout_s`` (or when the host cancels the trajectory) the CLI's whole process tree is
   killed and the agent raises, so the host marks the trajectory failed and the run goes on;
4. the CLI's final answer becomes ``AgentResult.response_text``, and the files it created,
   changed or deleted in the working directory go to ``AgentResult.metadata["changed_files"]``
   (``{path: text or None}``) for the reward.

The CLI is looked up in ``binary`` (a path), then in ``.tools/npm/node_modules/.bin`` (where
``scripts/install_agent_clis.sh`` installs the pinned versions) of the current directory, its
parents and this repository, then on ``PATH``. A missing CLI fails ``loongsage validate`` with a
line saying how to install it (:func:`check_cli_args`).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shlex
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import attrs

from loongsage_hookspecs import AgentContext, AgentResult, RunsPrograms

from .sandbox_mounts import tool_paths
from .sandbox_procs import kill_tree

INSTALL_SCRIPT = "scripts/install_agent_clis.sh"
TOOLS_BIN = Path(".tools") / "npm" / "node_modules" / ".bin"
SKIPPED_DIRS = frozenset({".git", "node_modules", "__pycache__", ".venv"})


class CliAgentError(RuntimeError):
    """The CLI failed: not found, a non-zero exit status, or an error it reported."""


class CliNotFoundError(CliAgentError, ValueError):
    """The CLI is not installed where the agent looks; the message says how to install it."""


def find_cli(binary: str, package: str, path: str | None = None) -> str:
    """The CLI's executable: ``path`` if given, else the project-local install, else ``PATH``."""
    if path:
        found = shutil.which(path) or (path if os.access(path, os.X_OK) and os.path.isfile(path) else None)
        if found is None:
            raise CliNotFoundError(f"binary '{path}' is not an executable file: fix the path, or drop it and run "
                                   f"`bash {INSTALL_SCRIPT}` to install the pinned {package}")
        return found
    roots = [Path.cwd(), *Path.cwd().parents, Path(__file__).resolve().parents[3]]
    tools = os.environ.get("LOONGSAGE_TOOLS_DIR")
    candidates = [Path(tools) / "npm" / "node_modules" / ".bin" / binary] if tools else []
    candidates += [root / TOOLS_BIN / binary for root in roots]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(binary)
    if found is None:
        raise CliNotFoundError(
            f"the '{binary}' CLI ({package}) is not installed: run `bash {INSTALL_SCRIPT}` in the LoongSage "
            f"checkout (installs the pinned version into {TOOLS_BIN}), or `npm install -g {package}`, or set "
            f"agent_args.binary to its path")
    return found


def prompt_text(prompt: Any) -> str:
    """The task as one string: a string prompt as is; for chat messages, the last user message."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users:
            content = users[-1].get("content")
            if isinstance(content, list):  # content parts
                return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            return str(content or "")
    return str(prompt)


def snapshot(root: str, max_files: int = 20000) -> dict[str, str]:
    """``relative path -> content digest`` of the files under ``root`` (skipping VCS and caches)."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
        for name in filenames:
            full = os.path.join(dirpath, name)
            if len(out) >= max_files or not os.path.isfile(full) or os.path.islink(full):
                continue
            try:
                with open(full, "rb") as f:
                    out[os.path.relpath(full, root)] = hashlib.sha1(f.read()).hexdigest()
            except OSError:
                continue
    return out


def changed_files(root: str, before: dict[str, str], max_chars: int = 65536) -> dict[str, str | None]:
    """Files created or changed since ``before`` (their text, cut at ``max_chars``), deleted ones as None."""
    after = snapshot(root)
    out: dict[str, str | None] = {}
    for rel, digest in sorted(after.items()):
        if before.get(rel) != digest:
            with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
                out[rel] = f.read(max_chars)
    for rel in sorted(set(before) - set(after)):
        out[rel] = None
    return out


class CliAgent:
    """One black-box CLI per trajectory (see the module docstring); subclasses say how to drive it.

    Args:
        args: extra command-line flags of the CLI, appended to the agent's own (a list, or a
            string split like a shell would).
        timeout_s: wall-clock limit of one run (default: the trajectory's timeout, else 600 s).
        binary: path of the CLI's executable (default: looked up, see :func:`find_cli`).
        model: the model name the CLI sends (the router serves the policy under any name).
        context_window: the context length the CLI is told the model has (tokens).
        max_output_tokens: the per-turn output limit the CLI is told (and sends).
        env: extra environment variables (they win over the agent's own).
        inherit_env: start from the host's whole environment instead of ``PATH`` and the locale.
        cwd: working directory when the trajectory has no sandbox (default: a fresh temporary one).
        keep_home: keep the throwaway home (its path is in the result's metadata) for debugging.
    """

    name: ClassVar[str] = ""
    binary_name: ClassVar[str] = ""
    package: ClassVar[str] = ""

    def __init__(self, args: list[str] | str | None = None, timeout_s: float | None = None, binary: str | None = None,
                 model: str = "policy", context_window: int = 32768, max_output_tokens: int = 1024,
                 env: dict[str, str] | None = None, inherit_env: bool = False, cwd: str | None = None,
                 keep_home: bool = False, max_output_bytes: int = 8_000_000) -> None:
        self.args = shlex.split(args) if isinstance(args, str) else [str(a) for a in (args or [])]
        self.timeout_s = timeout_s
        self.executable = find_cli(self.binary_name, self.package, binary)
        self.model = model
        self.context_window = int(context_window)
        self.max_output_tokens = int(max_output_tokens)
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.inherit_env = inherit_env
        self.cwd = cwd
        self.keep_home = keep_home
        self.max_output_bytes = max_output_bytes

    # -- what a subclass provides ---------------------------------------------------------------
    def configure(self, home: str, ctx: AgentContext, workdir: str) -> dict[str, str]:
        """Write the CLI's config under ``home``; return the environment variables it needs."""
        raise NotImplementedError

    def command(self, prompt: str, home: str, workdir: str) -> list[str]:
        """The CLI's non-interactive command line (before the user's ``args``), prompt included."""
        raise NotImplementedError

    def answer(self, stdout: str, stderr: str, home: str) -> str:
        """The final answer from the CLI's output; raises :class:`CliAgentError` on a reported error."""
        raise NotImplementedError

    # -- the run --------------------------------------------------------------------------------
    def base_env(self, home: str) -> dict[str, str]:
        env = dict(os.environ) if self.inherit_env else {
            k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TZ", "TERM")}
        env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
        env.setdefault("LANG", "C.UTF-8")
        tmp = os.path.join(home, "tmp")
        os.makedirs(tmp, exist_ok=True)
        env.update({"HOME": home, "USER": os.environ.get("USER", "loongsage"), "TMPDIR": tmp,
                    "XDG_CONFIG_HOME": os.path.join(home, ".config"), "XDG_CACHE_HOME": os.path.join(home, ".cache"),
                    "XDG_DATA_HOME": os.path.join(home, ".local", "share"),
                    "XDG_STATE_HOME": os.path.join(home, ".local", "state"),
                    "NO_COLOR": "1", "CI": "1", "TERM": "dumb"})
        return env

    async def run(self, ctx: AgentContext) -> AgentResult:
        if isinstance(ctx.sandbox, RunsPrograms):
            return await self._run_in_sandbox(ctx, ctx.sandbox)
        home = tempfile.mkdtemp(prefix=f"loongsage-{self.binary_name}-home-")
        scratch = None
        try:
            if ctx.sandbox is not None:
                workdir = ctx.sandbox.workdir
            elif self.cwd:
                workdir = self.cwd
            else:
                workdir = scratch = tempfile.mkdtemp(prefix=f"loongsage-{self.binary_name}-work-")
            env = self.base_env(home)
            env.update(self.configure(home, ctx, workdir))
            env.update(self.env)
            argv = [self.executable, *self.command(prompt_text(ctx.prompt), home, workdir), *self.args]
            before = snapshot(workdir)
            timeout = self.timeout_s or ctx.timeout_s or 600.0
            out, err, code = await self._run(argv, env, workdir, timeout)
            stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
            if code != 0:
                raise CliAgentError(f"{self.name} agent: {self.binary_name} exited with status {code}: "
                                    f"{(stderr or stdout)[-2000:]}")
            response = self.answer(stdout, stderr, home)
            meta: dict[str, Any] = {"cli": self.binary_name, "exit_code": code,
                                    "changed_files": changed_files(workdir, before)}
            if self.keep_home:
                meta["home"] = home
            return AgentResult(response_text=response, metadata=meta)
        finally:
            if not self.keep_home:
                shutil.rmtree(home, ignore_errors=True)
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)

    async def _run_in_sandbox(self, ctx: AgentContext, box: Any) -> AgentResult:
        """The CLI inside the trajectory's sandbox: its home under the sandbox's, its process as the
        sandbox's user under its isolation and limits, the router reached through the sandbox's
        loopback bridge, nothing of the host's environment but ``PATH`` and the locale."""
        base_url, bridge = box.bridge(ctx.base_url)
        home = tempfile.mkdtemp(prefix=f"{self.binary_name}-", dir=box.home)
        workdir = box.workdir
        inner = attrs.evolve(ctx, base_url=base_url)
        env = {k: v for k, v in self.base_env(home).items() if k != "USER"}
        env["TMPDIR"] = os.path.join(home, "tmp")
        env.update(self.configure(home, inner, workdir))
        env.update(self.env)
        box.own(home)
        argv = [self.executable, *self.command(prompt_text(ctx.prompt), home, workdir), *self.args]
        before = snapshot(workdir)
        timeout = self.timeout_s or ctx.timeout_s or 600.0
        done = await box.arun_program(argv, env=env, timeout_s=timeout, bridge=bridge,
                                      max_output_bytes=self.max_output_bytes, budgeted=True,
                                      read_only=tool_paths(self.executable, env.get("PATH")))
        if done.timed_out:
            raise TimeoutError(f"{self.name} agent: {self.binary_name} did not finish within {timeout:g}s "
                               "(its process tree was killed)")
        stdout, stderr = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
        if done.exit_code != 0:
            raise CliAgentError(f"{self.name} agent: {self.binary_name} exited with status {done.exit_code} in the "
                                f"sandbox: {(stderr or stdout)[-2000:]}")
        response = self.answer(stdout, stderr, home)
        meta: dict[str, Any] = {"cli": self.binary_name, "exit_code": done.exit_code, "sandboxed": True,
                                "changed_files": changed_files(workdir, before)}
        if self.keep_home:
            meta["home"] = home  # inside the sandbox: gone with it
        return AgentResult(response_text=response, metadata=meta)

    async def _run(self, argv: list[str], env: dict[str, str], cwd: str, timeout: float) -> tuple[bytes, bytes, int]:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, cwd=cwd, env=env, start_new_session=True, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        except OSError as exc:
            raise CliAgentError(f"{self.name} agent: cannot start {argv[0]!r}: {exc}") from exc
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except asyncio.TimeoutError:
            kill_tree(proc.pid, None)
            await _reap(proc)
            raise TimeoutError(f"{self.name} agent: {self.binary_name} did not finish within {timeout:g}s "
                               "(its process tree was killed)") from None
        except BaseException:  # cancelled by the host (trajectory timeout, shutdown)
            kill_tree(proc.pid, None)
            await _reap(proc)
            raise
        try:  # daemons the CLI left behind in its process group (shells, servers) go with it
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return out[-self.max_output_bytes:], err[-self.max_output_bytes:], proc.returncode or 0


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Wait for a killed process so its pipes close on this event loop (also when cancelled)."""
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), 5)
    except (asyncio.CancelledError, asyncio.TimeoutError):
        pass


def check_cli_args(agent_cls: type[CliAgent], args: dict[str, Any]) -> None:
    """What ``loongsage validate`` checks for a CLI agent: its arguments and that the CLI is installed."""
    import inspect

    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    valid = {name for cls in {CliAgent, agent_cls} for name, p in inspect.signature(cls.__init__).parameters.items()
             if p.kind in kinds and name != "self"}
    unknown = sorted(set(args) - valid)
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(unknown)} of the {agent_cls.name} agent; "
                         f"valid: {', '.join(sorted(valid))}")
    extra = getattr(agent_cls, "check_extra_args", None)
    if extra is not None:
        extra(args)
    find_cli(agent_cls.binary_name, agent_cls.package, args.get("binary"))
