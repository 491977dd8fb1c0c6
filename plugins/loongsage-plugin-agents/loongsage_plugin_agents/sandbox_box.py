"""One trajectory's ``local`` sandbox: its directory, host-side file access, its programs and its
bridge to the router.

Layout: ``<root>/<owner>--<trajectory>-<random>/`` holds ``work/`` (:attr:`LocalSandbox.workdir`,
where the row's repository snapshot is copied and the agent works) and ``home/`` (``HOME`` and,
outside bubblewrap, ``TMPDIR`` of every command; black-box agents keep their config there).

A :class:`LocalSandbox` runs programs through its provider's command line (isolation, launcher,
limits: :mod:`.local_sandbox`, :mod:`.sandbox_isolation`) and :mod:`.sandbox_procs` (waiting,
capped output, killing the whole tree), keeps the trajectory's wall-clock budget, and relays a
black-box agent's connections to the router through a Unix socket (:meth:`LocalSandbox.bridge`).
Split out of :mod:`.local_sandbox` so the per-trajectory object reads apart from the provider that
creates, limits and sweeps sandboxes.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence
from urllib.parse import urlsplit, urlunsplit

from loongsage_hookspecs import ExecResult

from .sandbox_errors import SandboxError
from .sandbox_launch import pump
from .sandbox_prepare import chown_tree
from .sandbox_procs import Completed, Launch, await_launch, kill_tree, kill_uid

SHELL = shutil.which("bash") or "/bin/sh"


class SandboxHost(Protocol):
    """What a sandbox asks of the provider that made it (:class:`.local_sandbox.LocalSandboxProvider`):
    the command line and environment of a program, output and time limits, the network setting."""

    max_output_bytes: int
    default_timeout_s: float

    @property
    def netns_for_programs(self) -> bool: ...

    def argv(self, box: "LocalSandbox", argv: list[str], *, bridge: dict[str, Any] | None = None,
             network: bool | None = None, read_only: Sequence[str] = ()) -> list[str]: ...

    def base_env(self, box: "LocalSandbox") -> dict[str, str]: ...

    def user_kwargs(self, box: "LocalSandbox") -> dict[str, Any]: ...


class LocalSandbox:
    """One trajectory's sandbox (see this module's and :mod:`.local_sandbox`'s docstrings)."""

    def __init__(self, provider: SandboxHost, trajectory_id: str, path: str, uid: int | None,
                 gid: int | None, marker: str, env: Mapping[str, str]) -> None:
        self.provider = provider
        self.trajectory_id = trajectory_id
        self.path = path
        self.workdir = os.path.join(path, "work")
        self.home = os.path.join(path, "home")
        self.uid, self.gid = uid, gid
        self.marker = marker
        self.env = dict(env)
        self.deadline: float | None = None
        self.pooled_uid: int | None = None
        """The uid this sandbox holds from the provider's pool (given back at teardown)."""
        self.destroyed = False
        self._lock = threading.Lock()
        self._launches: set[Launch] = set()
        self._count = 0
        self._bridges: dict[tuple[str, int], socket.socket] = {}

    # ------------------------------------------------------------------ host-side file access
    def _path(self, relative: str) -> Path:
        """``relative`` inside the workdir; escaping paths (``..``, absolute, symlinks) are refused."""
        root = Path(self.workdir).resolve()
        target = (root / relative).resolve()
        if target != root and root not in target.parents:
            raise SandboxError(f"path {relative!r} is outside the sandbox directory")
        return target

    def write_file(self, relative: str, content: str | bytes) -> str:
        """Write a file inside the sandbox (from the host side); returns its absolute path."""
        self._check_alive()
        path = self._path(relative)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        if self.uid is not None:
            for p in [path, *path.parents]:
                if p == Path(self.workdir).resolve().parent:
                    break
                os.lchown(p, self.uid, self.gid if self.gid is not None else -1)
        return str(path)

    def write_home_file(self, relative: str, content: str | bytes) -> str:
        """Write a file under the sandbox's ``home`` (an agent's config, prompt...), owned by its user."""
        self._check_alive()
        home = Path(self.home).resolve()
        path = (home / relative).resolve()
        if home not in path.parents:
            raise SandboxError(f"path {relative!r} is outside the sandbox's home")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        if self.uid is not None:
            chown_tree(str(home), self.uid, self.gid if self.gid is not None else -1)
        return str(path)

    def own(self, path: str) -> None:
        """Give ``path`` (a tree under the sandbox's directory, written by the host) to the sandbox's user."""
        if self.uid is not None:
            chown_tree(path, self.uid, self.gid if self.gid is not None else -1)

    def read_file(self, relative: str) -> str:
        """Read a text file inside the sandbox (from the host side)."""
        self._check_alive()
        return self._path(relative).read_text(errors="replace")

    def _check_alive(self) -> None:
        if self.destroyed:
            raise SandboxError(f"sandbox of trajectory {self.trajectory_id!r} was destroyed")

    # ------------------------------------------------------------------ programs
    def remaining_s(self) -> float | None:
        """Seconds left of the trajectory's wall-clock budget (``None``: unbounded)."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def _launch(self, argv: list[str], *, env: Mapping[str, str] | None, stdin: bytes | None,
                bridge: dict[str, Any] | None, network: bool | None, max_output_bytes: int | None,
                read_only: Sequence[str] = ()) -> Launch:
        self._check_alive()
        p = self.provider
        with self._lock:
            self._count += 1
            marker = f"{self.marker}:{self._count}"
        full_env = {**p.base_env(self), **self.env, **(env or {})}
        launch = Launch(p.argv(self, argv, bridge=bridge, network=network, read_only=read_only), env=full_env,
                        cwd=self.workdir,
                        marker=marker, stdin=stdin,
                        max_output_bytes=p.max_output_bytes if max_output_bytes is None else int(max_output_bytes),
                        user_kwargs=p.user_kwargs(self))
        with self._lock:
            self._launches.add(launch)
        return launch

    def _finish(self, launch: Launch, timeout: float | None) -> Completed:
        try:
            return launch.wait(timeout)
        finally:
            with self._lock:
                self._launches.discard(launch)

    def _timeout(self, timeout_s: float | None, budgeted: bool) -> float | Completed:
        """The wall-clock limit of one program, or the refusal once the trajectory's budget is spent."""
        timeout = self.provider.default_timeout_s if timeout_s is None else float(timeout_s)
        if budgeted and self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                return Completed(exit_code=124, stdout=b"", timed_out=True,
                                 stderr=b"sandbox: the trajectory's time budget (trajectory_timeout_s) is spent\n")
            timeout = min(timeout, left)
        return timeout

    def run_program(self, argv: list[str], *, env: Mapping[str, str] | None = None, stdin: bytes | None = None,
                    timeout_s: float | None = None, bridge: dict[str, Any] | None = None,
                    network: bool | None = None, max_output_bytes: int | None = None,
                    budgeted: bool = False, read_only: Sequence[str] = ()) -> Completed:
        """Run ``argv`` in the sandbox (synchronously) with everything the module docstring lists.

        ``budgeted``: the call also counts against the trajectory's wall-clock budget.
        ``bridge``: what :meth:`bridge` returned, for a program that must reach the router.
        ``read_only``: host paths the program needs (a CLI's install, its interpreter), visible
        read-only in the sandbox wherever they are (a private ``/tmp`` hides them otherwise).
        """
        timeout = self._timeout(timeout_s, budgeted)
        if isinstance(timeout, Completed):
            return timeout
        launch = self._launch(argv, env=env, stdin=stdin, bridge=bridge, network=network,
                              max_output_bytes=max_output_bytes, read_only=read_only)
        return self._finish(launch, timeout)

    async def arun_program(self, argv: list[str], *, env: Mapping[str, str] | None = None,
                           stdin: bytes | None = None, timeout_s: float | None = None,
                           bridge: dict[str, Any] | None = None, network: bool | None = None,
                           max_output_bytes: int | None = None, budgeted: bool = False,
                           read_only: Sequence[str] = ()) -> Completed:
        """:meth:`run_program` from the event loop: it waits in a thread, and cancelling the
        awaiting task kills the program's whole tree."""
        timeout = self._timeout(timeout_s, budgeted)
        if isinstance(timeout, Completed):
            return timeout

        def start() -> Launch:
            return self._launch(argv, env=env, stdin=stdin, bridge=bridge, network=network,
                                max_output_bytes=max_output_bytes, read_only=read_only)

        def finish(launch: Launch) -> None:
            with self._lock:
                self._launches.discard(launch)

        return await await_launch(start, timeout, finish, name=f"sandbox-{self.trajectory_id}")

    def run(self, command: str, *, timeout_s: float | None = None) -> ExecResult:
        """Run a shell command in the sandbox, synchronously (for rewards, in a worker thread)."""
        return _exec_result(self.run_program([SHELL, "-c", command], timeout_s=timeout_s))

    async def exec(self, command: str, *, timeout_s: float | None = None) -> ExecResult:
        """Run a shell command in the sandbox for an agent; it counts against the trajectory's budget."""
        return _exec_result(await self.arun_program([SHELL, "-c", command], timeout_s=timeout_s, budgeted=True))

    # ------------------------------------------------------------------ reaching the router
    def bridge(self, url: str) -> tuple[str, dict[str, Any] | None]:
        """``(url as the sandboxed program must use it, bridge settings for run_program)``.

        When the sandbox has its own network namespace, ``url``'s host and port become
        ``127.0.0.1:<port>`` inside it, relayed through a Unix socket to ``url``'s host and port
        (the router) and nowhere else. Without a namespace the URL is returned as it is.
        """
        if not self.provider.netns_for_programs:
            return url, None
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)
        path = os.path.join(self.path, f"bridge-{port}.sock")
        with self._lock:
            if (host, port) not in self._bridges:
                self._bridges[(host, port)] = _serve_bridge(path, host, port, self.uid, self.gid)
        inner = urlunsplit((parts.scheme, f"127.0.0.1:{port}", parts.path, parts.query, parts.fragment))
        return inner, {"port": port, "socket": path}

    # ------------------------------------------------------------------ teardown
    def kill_all(self) -> None:
        """Kill every process of this sandbox (all commands, and whatever they left running)."""
        with self._lock:
            launches = list(self._launches)
        for launch in launches:
            launch.killed = True
        kill_tree(None, f"{self.marker}:")
        for launch in launches:
            kill_tree(launch.proc.pid, launch.marker)
        if self.pooled_uid is not None:
            kill_uid(self.pooled_uid)

    def close_bridges(self) -> None:
        with self._lock:
            bridges, self._bridges = list(self._bridges.values()), {}
        for listener in bridges:
            try:
                listener.close()
            except OSError:
                pass


def _exec_result(done: Completed) -> ExecResult:
    return ExecResult(exit_code=done.exit_code, stdout=done.stdout.decode(errors="replace"),
                      stderr=done.stderr.decode(errors="replace"), timed_out=done.timed_out, truncated=done.truncated)


def _serve_bridge(path: str, host: str, port: int, uid: int | None, gid: int | None) -> socket.socket:
    """A Unix socket at ``path`` whose every connection is relayed to ``host:port`` (the router)."""
    if os.path.lexists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    if uid is not None:
        os.chown(path, uid, gid if gid is not None else -1)
    os.chmod(path, 0o600)
    listener.listen(64)

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection((host, port), timeout=10)
                upstream.settimeout(None)
            except OSError:
                conn.close()
                continue
            threading.Thread(target=pump, args=(conn, upstream), daemon=True).start()
            threading.Thread(target=pump, args=(upstream, conn), daemon=True).start()

    threading.Thread(target=accept, name=f"sandbox-bridge-{port}", daemon=True).start()
    return listener
