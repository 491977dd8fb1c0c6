"""A server subprocess in its own process group, with its output in a log file.

Both the SGLang server and the sglang-router are started this way: :class:`ManagedProcess`
launches a command line with ``start_new_session`` (so the server and every child it forks share
one process group that :meth:`ManagedProcess.stop` terminates together), writes stdout and stderr
to a log file, and waits until an HTTP health endpoint answers 200. A failure to come up raises
:class:`ServerStartError` with the command, the exit status and the tail of the log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

import httpx


class ServerStartError(RuntimeError):
    """A server subprocess exited or did not become healthy in time; the message has its log tail."""


def log_tail(path: str | os.PathLike[str] | None, max_lines: int = 40) -> str:
    """The last ``max_lines`` lines of a log file ('' when there is none)."""
    if not path:
        return ""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-max_lines:])


SECRET_FLAGS = ("--api-key", "--admin-api-key")
"""Flags whose value is the run secret: masked wherever a command line is shown."""


def secret_args(*flags: str, secret: str) -> list[str]:
    """``--flag=SECRET`` for each flag: one argument each, so a secret that starts with ``-`` (a
    URL-safe token does, one time in 64) is never read as an option by the server's parser."""
    return [f"{flag}={secret}" for flag in flags]


def redact_command(command: Sequence[str]) -> list[str]:
    """``command`` with the values of :data:`SECRET_FLAGS` replaced by ``***`` (``--flag VALUE``
    and ``--flag=VALUE``)."""
    out = []
    for i, arg in enumerate(command):
        flag = arg.split("=", 1)[0]
        if flag in SECRET_FLAGS and "=" in arg:
            out.append(f"{flag}=***")
        else:
            out.append("***" if i > 0 and command[i - 1] in SECRET_FLAGS else arg)
    return out


class ManagedProcess:
    """One server command line run as a subprocess in a new process group.

    ``name`` labels errors (``"sglang server"``); ``log_path`` receives stdout and stderr (a file
    in a fresh temporary directory when not given); ``env`` is added to this process's environment.
    """

    def __init__(self, command: Sequence[str], *, name: str, log_path: str | os.PathLike[str] | None = None,
                 env: Mapping[str, str] | None = None, cwd: str | None = None) -> None:
        if not command:
            raise ValueError(f"{name}: empty command line")
        self.command = [str(c) for c in command]
        self.name = name
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="loongsage-")) / "server.log"
        self.env = dict(env or {})
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        """Launch the command (idempotent while it runs)."""
        if self.proc is not None and self.proc.poll() is None:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        with open(self.log_path, "ab") as log:
            log.write(("$ " + " ".join(redact_command(self.command)) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=self.cwd, start_new_session=True)

    def failure(self, reason: str) -> ServerStartError:
        """A :class:`ServerStartError` for ``reason`` with the command line and the log tail."""
        tail = log_tail(self.log_path)
        return ServerStartError(f"{self.name} {reason}\ncommand: {' '.join(redact_command(self.command))}\n"
                                f"log: {self.log_path}"
                                + (f"\n--- last lines of the log ---\n{tail}" if tail else ""))

    def wait_healthy(self, base_url: str, paths: Sequence[str] = ("/health",), timeout_s: float = 600.0,
                     interval_s: float = 0.2) -> None:
        """Poll ``base_url + path`` for each of ``paths`` in turn until one answers 200.

        Raises :class:`ServerStartError` if the process exits first or ``timeout_s`` passes.
        """
        if self.proc is None:
            raise RuntimeError(f"{self.name}: wait_healthy before start")
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise self.failure(f"exited with status {code} before it became healthy")
                for path in paths:
                    try:
                        if client.get(base_url.rstrip("/") + path).status_code == 200:
                            return
                    except httpx.HTTPError:
                        pass
                if time.monotonic() > deadline:
                    raise self.failure(f"did not answer {' or '.join(paths)} at {base_url} within {timeout_s:g} s")
                time.sleep(interval_s)

    def launch(self, base_url: str, paths: Sequence[str], timeout_s: float) -> str:
        """Start the process and wait until it answers on ``base_url``; stop it if it never does."""
        self.start()
        try:
            self.wait_healthy(base_url, paths, timeout_s=timeout_s)
        except BaseException:
            self.stop()
            raise
        return base_url

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the whole process group, SIGKILL it after ``grace_s``; idempotent."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=grace_s)
        # children that outlived the group leader still hold the group id
        _signal_group(proc.pid, signal.SIGKILL)
        self.proc = None


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
