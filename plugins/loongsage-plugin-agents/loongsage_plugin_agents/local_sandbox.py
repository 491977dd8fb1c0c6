"""The ``local`` sandbox: a per-trajectory working directory on this machine, with OS limits.

Every command runs with ``cwd`` = the sandbox's directory, ``HOME`` = that directory, a small
fixed environment, its own session (so a timeout kills the whole process group) and resource
limits set with ``setrlimit`` in the child before ``exec``: CPU seconds, address space, file size,
open files and, when commands run as a dedicated user, the number of processes.

Isolation (``isolation=``) is what the OS offers, detected when the provider is built:

``bwrap``
    bubblewrap (Debian: ``apt-get install -y bubblewrap``): the whole file system is mounted
    read-only except the sandbox directory; ``/tmp`` and ``/dev/shm`` are private and empty; no
    network (own network namespace with only a down loopback), own PID/IPC/UTS namespaces,
    all capabilities dropped (so even a root command cannot remount anything writable), killed
    when the host dies. Writes outside the directory fail with "Read-only file system".
``netns``
    ``unshare -n`` only (no bubblewrap, but network namespaces are permitted): no network;
    the file system is NOT protected beyond normal permissions.
``none``
    neither is available: working directory, environment and resource limits only.

``auto`` (the default) picks the first that works; :attr:`LocalSandboxProvider.enforced` says
what is in force. When the host runs as root, commands run as ``run_as_user`` (default
``nobody``) so the process limit applies per sandbox user and the directory is theirs.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import resource
import shutil
import signal
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any, Callable

from loongsage_hookspecs import ExecResult

ISOLATIONS = ("auto", "bwrap", "netns", "none")
_SHELL = shutil.which("bash") or "/bin/sh"


@cache
def _works(argv: tuple[str, ...], uid: int | None = None, gid: int | None = None) -> bool:
    """Whether ``argv`` runs and exits 0 here as ``uid`` (cached: used to detect isolation support)."""
    kwargs: dict[str, Any] = {} if uid is None else {"user": uid, "group": gid, "extra_groups": []}
    try:
        return subprocess.run(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd="/",
                              stderr=subprocess.DEVNULL, timeout=20, **kwargs).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def detect_isolation(uid: int | None = None, gid: int | None = None) -> str:
    """The strongest isolation that works here for commands run as ``uid``: ``bwrap``, ``netns`` or ``none``."""
    bwrap = shutil.which("bwrap")
    if bwrap and _works((bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--unshare-net", "--cap-drop", "ALL",
                         "--die-with-parent", "true"), uid, gid):
        return "bwrap"
    unshare = shutil.which("unshare")
    if unshare and (_works((unshare, "-n", "true"), uid, gid) or _works((unshare, "-n", "-r", "true"), uid, gid)):
        return "netns"
    return "none"


class SandboxError(RuntimeError):
    """A sandbox operation was refused (a path outside the sandbox, a destroyed sandbox, ...)."""


class LocalSandbox:
    """One trajectory's sandbox: a directory plus :meth:`exec` to run shell commands in it."""

    def __init__(self, provider: "LocalSandboxProvider", trajectory_id: str, workdir: str) -> None:
        self.provider = provider
        self.trajectory_id = trajectory_id
        self.workdir = workdir
        self.destroyed = False
        self._procs: set[asyncio.subprocess.Process] = set()

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
        self.provider._own(path)
        return str(path)

    def read_file(self, relative: str) -> str:
        """Read a text file inside the sandbox (from the host side)."""
        self._check_alive()
        return self._path(relative).read_text(errors="replace")

    def _check_alive(self) -> None:
        if self.destroyed:
            raise SandboxError(f"sandbox of trajectory {self.trajectory_id!r} was destroyed")

    async def exec(self, command: str, *, timeout_s: float | None = None) -> ExecResult:
        """Run ``command`` with the shell in the sandbox; a timeout kills its process group."""
        self._check_alive()
        p = self.provider
        timeout = p.default_timeout_s if timeout_s is None else timeout_s
        proc = await asyncio.create_subprocess_exec(
            *p.argv(self.workdir, command), cwd=self.workdir, env=p.env(self.workdir),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, preexec_fn=p.preexec(), **p.user_kwargs())
        self._procs.add(proc)
        limit = p.max_output_bytes
        out, err = bytearray(), bytearray()
        readers = [asyncio.ensure_future(_drain(proc.stdout, out, limit)),
                   asyncio.ensure_future(_drain(proc.stderr, err, limit))]
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            timed_out = True
            _kill_group(proc)
            await proc.wait()
        except BaseException:
            _kill_group(proc)
            try:
                await asyncio.wait_for(asyncio.shield(proc.wait()), 5)
            except (asyncio.CancelledError, asyncio.TimeoutError):
                pass
            raise
        finally:
            self._procs.discard(proc)
            # output pipes close when the last process holding them exits; don't wait forever
            done, pending = await asyncio.wait(readers, timeout=2)
            for task in pending:
                task.cancel()
        code = proc.returncode if proc.returncode is not None else -1
        return ExecResult(exit_code=124 if timed_out else code, stdout=out.decode(errors="replace"),
                          stderr=err.decode(errors="replace"), timed_out=timed_out)

    def kill_all(self) -> None:
        for proc in list(self._procs):
            _kill_group(proc)


async def _drain(stream: asyncio.StreamReader | None, buf: bytearray, limit: int) -> None:
    """Read ``stream`` to its end, keeping the first ``limit`` bytes (so a timeout keeps partial output)."""
    if stream is None:
        return
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return
        if len(buf) < limit:
            buf.extend(chunk[: limit - len(buf)])


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class LocalSandboxProvider:
    """Creates :class:`LocalSandbox` directories under ``root`` (a temp dir by default).

    Args:
        root: parent directory of the sandbox directories.
        isolation: ``auto``, ``bwrap``, ``netns`` or ``none`` (see the module docstring); asking
            for one that does not work here is an error.
        network: allow network access (disables the network namespace).
        cpu_time_s, memory_mb, file_size_mb, max_open_files, max_processes: resource limits
            per command (``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``,
            ``RLIMIT_NPROC``; the last only when commands run as a dedicated user, since it counts
            all processes of the user).
        default_timeout_s: wall-clock limit of a command without its own timeout.
        max_output_bytes: stdout/stderr kept per command.
        run_as_user: user commands run as when the host is root (``None`` keeps root).
        env: extra environment variables for commands.
    """

    def __init__(self, root: str | None = None, isolation: str = "auto", network: bool = False,
                 cpu_time_s: int = 60, memory_mb: int = 2048, file_size_mb: int = 256, max_open_files: int = 1024,
                 max_processes: int = 512, default_timeout_s: float = 60.0, max_output_bytes: int = 1_000_000,
                 run_as_user: str | None = "nobody", env: dict[str, str] | None = None) -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"local sandbox: isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
        self.user: pwd.struct_passwd | None = None
        if os.geteuid() == 0 and run_as_user:
            try:
                self.user = pwd.getpwnam(run_as_user)
            except KeyError:
                raise SandboxError(f"local sandbox: run_as_user {run_as_user!r} does not exist") from None
        uid, gid = (self.user.pw_uid, self.user.pw_gid) if self.user else (None, None)
        found = detect_isolation(uid, gid)
        if isolation == "auto":
            isolation = found
        elif isolation == "bwrap" and found != "bwrap":
            raise SandboxError("local sandbox: isolation='bwrap' but bubblewrap does not work here "
                               "(install it: apt-get install -y bubblewrap)")
        elif isolation == "netns" and found == "none":
            raise SandboxError("local sandbox: isolation='netns' but 'unshare -n' is not permitted here")
        self.isolation = isolation
        self.network = network
        self.root = os.path.abspath(root) if root else None
        self.limits = {
            resource.RLIMIT_CPU: int(cpu_time_s),
            resource.RLIMIT_AS: int(memory_mb) * 1024 * 1024,
            resource.RLIMIT_FSIZE: int(file_size_mb) * 1024 * 1024,
            resource.RLIMIT_NOFILE: int(max_open_files),
        }
        self.default_timeout_s = default_timeout_s
        self.max_output_bytes = max_output_bytes
        self.extra_env = dict(env or {})
        if self.user is not None:
            self.limits[resource.RLIMIT_NPROC] = int(max_processes)
        self._sandboxes: dict[str, LocalSandbox] = {}

    @property
    def enforced(self) -> dict[str, Any]:
        """What this provider actually enforces on this machine."""
        return {
            "isolation": self.isolation,
            "filesystem": "read-only outside the sandbox directory" if self.isolation == "bwrap"
            else "normal file permissions only",
            "network": "allowed" if self.network or self.isolation == "none" else "blocked",
            "user": self.user.pw_name if self.user else pwd.getpwuid(os.geteuid()).pw_name,
            "limits": {resource_name(k): v for k, v in self.limits.items()},
        }

    # ------------------------------------------------------------------ pieces used by exec
    def argv(self, workdir: str, command: str) -> list[str]:
        shell = [_SHELL, "-c", command]
        if self.isolation == "bwrap":
            argv = [shutil.which("bwrap") or "bwrap", "--ro-bind", "/", "/", "--tmpfs", "/tmp",
                    "--bind", workdir, workdir, "--dev", "/dev", "--proc", "/proc",
                    "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session",
                    "--cap-drop", "ALL", "--chdir", workdir]
            if not self.network:
                argv.append("--unshare-net")
            return argv + ["--"] + shell
        if self.isolation == "netns" and not self.network:
            unshare = shutil.which("unshare") or "unshare"
            uid, gid = (self.user.pw_uid, self.user.pw_gid) if self.user else (None, None)
            flags = ["-n"] if _works((unshare, "-n", "true"), uid, gid) else ["-n", "-r"]
            return [unshare, *flags, "--"] + shell
        return shell

    def env(self, workdir: str) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "HOME": workdir,
                "TMPDIR": "/tmp" if self.isolation == "bwrap" else workdir, "LANG": "C.UTF-8",
                "PYTHONDONTWRITEBYTECODE": "1", **self.extra_env}

    def preexec(self) -> Callable[[], None]:
        limits = dict(self.limits)

        def apply() -> None:  # runs in the child between fork and exec
            for which, value in limits.items():
                resource.setrlimit(which, (value, value))

        return apply

    def user_kwargs(self) -> dict[str, Any]:
        if self.user is None:
            return {}
        return {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}

    def _check_reachable(self, root: str) -> None:
        """Commands run as the sandbox user must be able to enter ``root``: check every parent."""
        if self.user is None:
            return
        uid, gid = self.user.pw_uid, self.user.pw_gid
        path = Path(root).resolve()
        for part in [path, *path.parents]:
            st = part.stat()
            bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == gid else 0o001
            if not st.st_mode & bit:
                raise SandboxError(f"local sandbox: user {self.user.pw_name!r} cannot enter {part} (mode "
                                   f"{oct(st.st_mode & 0o777)}), so sandboxes under {root} would not work; pick a "
                                   f"'root' it can reach or set run_as_user = none")

    def _own(self, path: Path) -> None:
        if self.user is not None:
            os.chown(path, self.user.pw_uid, self.user.pw_gid)

    # ------------------------------------------------------------------ provider API
    async def create(self, trajectory_id: str) -> LocalSandbox:
        """A fresh, empty directory for ``trajectory_id`` (owned by the sandbox user)."""
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in trajectory_id)[:64]
        if self.root:
            os.makedirs(self.root, exist_ok=True)
        self._check_reachable(self.root or tempfile.gettempdir())
        workdir = tempfile.mkdtemp(prefix=f"sandbox-{safe}-", dir=self.root)
        os.chmod(workdir, 0o700)
        self._own(Path(workdir))
        sandbox = LocalSandbox(self, trajectory_id, os.path.realpath(workdir))
        self._sandboxes[sandbox.workdir] = sandbox
        return sandbox

    async def destroy(self, sandbox: LocalSandbox) -> None:
        """Kill the sandbox's running commands and delete its directory (idempotent)."""
        sandbox.kill_all()
        sandbox.destroyed = True
        self._sandboxes.pop(sandbox.workdir, None)
        _force_rmtree(sandbox.workdir)

    async def close(self) -> None:
        """Destroy every sandbox this provider still holds."""
        for sandbox in list(self._sandboxes.values()):
            await self.destroy(sandbox)


def resource_name(which: int) -> str:
    for name in ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_NPROC"):
        if getattr(resource, name) == which:
            return name
    return str(which)


def _force_rmtree(path: str) -> None:
    """Remove ``path`` even if the sandboxed program made parts of it read-only."""
    def retry(func: Callable[..., Any], p: str, _: Any) -> None:
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
        except OSError:
            pass
        try:
            func(p)
        except FileNotFoundError:
            pass

    if os.path.lexists(path):
        shutil.rmtree(path, onerror=retry)
