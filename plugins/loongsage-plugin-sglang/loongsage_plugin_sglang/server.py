"""The ``sglang`` rollout engine: one SGLang server subprocess per engine actor.

``SGLangServer(ctx)`` turns the job into a ``python -m sglang.launch_server`` command line (see
:mod:`.launch`); :meth:`SGLangServer.start` checks that SGLang is importable by that Python,
launches the server in its own process group with its output in a log file, waits for
``/health_generate`` (or ``/health``) and returns ``http://HOST:PORT``; :meth:`SGLangServer.shutdown`
terminates the process group. The server is then reached only through SGLang's native HTTP API.

Three ``[rollout] engine_args`` keys configure the launcher itself and are not passed to SGLang:
``startup_timeout_s`` (default 900), ``log_dir`` (default: a fresh temporary directory; the log is
``sglang_engine_<index>.log``) and ``env`` (a table of extra environment variables).

With the run secret (``EngineContext.api_key``) the server is launched with ``--api-key`` and
``--admin-api-key`` set to it, so generation and every control endpoint (weight updates,
pause/continue, memory release) need ``Authorization: Bearer <secret>``; the secret is masked in
the logged command line. The server listens on ``EngineContext.host`` (the node's address on a
multi-node Ray cluster) and refuses to start beyond loopback without the secret.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping

from loongsage_core.backend_api.distributed import free_port, retry_on_port_collision
from loongsage_core.backend_api.serving import check_listen_address
from loongsage_hookspecs import EngineContext, JobSettings

from .launch import LaunchConfigError, build_launch_command
from .process import ManagedProcess, ServerStartError, secret_args

INSTALL_HINT = "pip install 'loongsage-plugin-sglang[sglang]'"
"""How to install SGLang next to this plugin."""

LAUNCHER_KEYS = ("startup_timeout_s", "log_dir", "env")
"""``engine_args`` keys read by the launcher (never passed to SGLang)."""

HEALTH_PATHS = ("/health_generate", "/health")


class SGLangNotInstalled(ServerStartError):
    """SGLang cannot be imported by the Python that would run the server."""


def sglang_available(python: str | None = None) -> bool:
    """Whether ``python`` (default: this interpreter) can import ``sglang`` (without importing it here)."""
    if python is None or Path(python).resolve() == Path(sys.executable).resolve():
        return importlib.util.find_spec("sglang") is not None
    probe = subprocess.run([python, "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('sglang') is None)"],
                           capture_output=True, timeout=60)
    return probe.returncode == 0


_FLAG_CHECK = """
import argparse, sys
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
ServerArgs.add_cli_args(parser)
try:
    _, unknown = parser.parse_known_args(sys.argv[1:])
except argparse.ArgumentError as exc:
    sys.exit(str(exc))
if unknown:
    sys.exit("unrecognized arguments: " + " ".join(unknown))
"""


def sglang_flag_error(python: str, argv: list[str]) -> str | None:
    """What the installed SGLang's own argument parser (``ServerArgs.add_cli_args``, run by
    ``python``) says of the launch flags ``argv`` (the command line after ``-m
    sglang.launch_server``): ``None`` when it accepts them, else its message. A flag this SGLang
    release does not know, or a value of the wrong type, is caught before a server is started."""
    probe = subprocess.run([python, "-c", _FLAG_CHECK, *argv], capture_output=True, text=True, timeout=300)
    if probe.returncode == 0:
        return None
    lines = (probe.stderr or probe.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {probe.returncode}"


def _launcher_options(job: JobSettings) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``engine_args`` into (launcher options, SGLang arguments), validating the former."""
    where = job.source_path or "<job>"
    args = dict(job.rollout.engine_args)
    opts = {k: args.pop(k) for k in LAUNCHER_KEYS if k in args}
    timeout = opts.get("startup_timeout_s", 900.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise LaunchConfigError(f"{where}: [rollout] engine_args.startup_timeout_s must be a positive number "
                                f"of seconds, got {timeout!r}")
    opts["startup_timeout_s"] = float(timeout)
    log_dir = opts.get("log_dir")
    if log_dir is not None and not isinstance(log_dir, str):
        raise LaunchConfigError(f"{where}: [rollout] engine_args.log_dir must be a path string, got {log_dir!r}")
    env = opts.get("env", {})
    if not isinstance(env, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise LaunchConfigError(f"{where}: [rollout] engine_args.env must be a table of string values, got {env!r}")
    opts["env"] = dict(env)
    return opts, args


def sglang_command(job: JobSettings, *, host: str = "127.0.0.1", port: int, engine_index: int = 0,
                   python: str | None = None) -> list[str]:
    """The SGLang argv for ``job`` with the launcher-only ``engine_args`` keys left out."""
    _, args = _launcher_options(job)
    return build_launch_command(job, host=host, port=port, engine_index=engine_index, python=python,
                                engine_args=args)


class SGLangServer:
    """A ``RolloutEngine`` that runs a real SGLang server as a subprocess.

    The command line is built (and the job validated) at construction, so a bad ``engine_args``
    fails before anything is launched; ``python`` picks the interpreter that runs SGLang.
    """

    def __init__(self, ctx: EngineContext, *, python: str | None = None) -> None:
        self.ctx = ctx
        job = ctx.job
        self.python = python or sys.executable
        self.options, _ = _launcher_options(job)
        self.host = ctx.host or "127.0.0.1"
        self.engine_index = int(ctx.engine_index)
        self.secret = ctx.api_key
        check_listen_address(self.host, self.secret, f"sglang server (engine {self.engine_index})")
        self.fixed_port = bool(ctx.port)
        """A port given in the context is used as is; otherwise a free one, another if it is taken first."""
        self.port = int(ctx.port) if ctx.port else free_port(self.host)
        self.command = self._command(self.port)
        log_dir = Path(job.resolve_path(self.options["log_dir"])) if self.options.get("log_dir") \
            else Path(tempfile.mkdtemp(prefix="loongsage-sglang-"))
        self.log_path = log_dir / f"sglang_engine_{self.engine_index}.log"
        self.process: ManagedProcess | None = None
        self.base_url: str | None = None

    def start(self) -> str:
        """Launch the server and wait until it serves; returns ``http://HOST:PORT``."""
        if self.base_url is not None:
            return self.base_url
        if not sglang_available(self.python):
            raise SGLangNotInstalled(f"the sglang rollout engine needs SGLang, which {self.python} cannot import; "
                                     f"install it with: {INSTALL_HINT} (it needs a CUDA machine), or select "
                                     "[rollout] engine = \"torch\"")
        plain = sglang_command(self.ctx.job, host=self.host, port=self.port, engine_index=self.engine_index,
                               python=self.python)  # without the run secret: it never reaches the probe
        error = sglang_flag_error(self.python, plain[plain.index("sglang.launch_server") + 1:])
        if error is not None:
            where = self.ctx.job.source_path or "<job>"
            raise LaunchConfigError(f"{where}: the installed SGLang refuses the launch command built from "
                                    f"[model] / [rollout] (engine_args included): {error}")
        name = f"sglang server (engine {self.engine_index})"
        if self.fixed_port:
            self.base_url = self._launch(self.port)
        else:  # the server binds its port itself, later: start it again on another port if that one was taken
            self.base_url = retry_on_port_collision(self._launch, host=self.host, first_port=self.port, where=name)
        return self.base_url

    def _command(self, port: int) -> list[str]:
        """The launch command line for ``port`` (with the run secret as the server's API keys when set)."""
        command = sglang_command(self.ctx.job, host=self.host, port=port, engine_index=self.engine_index,
                                 python=self.python)
        return command + (secret_args("--api-key", "--admin-api-key", secret=self.secret) if self.secret else [])

    def _launch(self, port: int) -> str:
        """Run the server on ``port`` and wait until it serves (stopped again if it never does)."""
        if port != self.port:
            self.port = port
            self.command = self._command(port)
        self.process = ManagedProcess(self.command, name=f"sglang server (engine {self.engine_index})",
                                      log_path=self.log_path, env=self.options["env"])
        return self.process.launch(f"http://{self.host}:{port}", HEALTH_PATHS,
                                   timeout_s=self.options["startup_timeout_s"])

    def shutdown(self) -> None:
        """Terminate the server's process group (idempotent)."""
        if self.process is not None:
            self.process.stop()
        self.base_url = None


def create_server(ctx: EngineContext) -> SGLangServer:
    """``factory(ctx: EngineContext) -> SGLangServer`` of the ``sglang`` rollout engine."""
    return SGLangServer(ctx)


__all__ = ["HEALTH_PATHS", "INSTALL_HINT", "LAUNCHER_KEYS", "SGLangNotInstalled", "SGLangServer", "create_server",
           "sglang_available", "sglang_command"]
