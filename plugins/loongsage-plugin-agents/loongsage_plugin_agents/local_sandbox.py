"""The ``local`` sandbox: a per-trajectory directory on this machine, prepared from the data row,
whose programs run unprivileged, isolated, limited and killed as a whole.

Layout: ``<root>/<owner>--<trajectory>-<random>/`` holds ``work/`` (:attr:`LocalSandbox.workdir`,
where the row's repository snapshot is copied and the agent works) and ``home/`` (``HOME`` and,
outside bubblewrap, ``TMPDIR`` of every command; black-box agents keep their config there).

Every program (a tool call's shell command, a reward's test command, a black-box agent's whole
process) goes through :mod:`.sandbox_launch` and gets:

* **an unprivileged user**: when the host is root, each sandbox has its own uid from a pool
  (``uid_base`` + n, no passwd entry needed; ``run_as_user = "auto"``), so sandboxes cannot touch
  each other or the host's files, the process limit counts per sandbox, and ``destroy`` kills
  every process of that uid; a named ``run_as_user`` shares one user among sandboxes;
* **a scrubbed environment**: ``PATH``, ``HOME``, ``TMPDIR``, ``LANG``, the provider's ``env``,
  the row's ``sandbox.env`` and what the caller passes; nothing else of the host's;
* **limits** (``setrlimit``): CPU seconds, address space, file size, open files, processes;
  a wall-clock limit per command (``default_timeout_s`` or the call's) and per trajectory
  (``trajectory_timeout_s``: the agent's commands and programs stop getting time once it is spent;
  rewards' :meth:`~LocalSandbox.run` calls have their own timeouts);
* **output capped while it is read** (``max_output_bytes`` per stream; the rest is read and dropped);
* **the whole process tree killed** at its timeout and at ``destroy``: by uid (above), by the
  marker in its environment, by process group and by ``/proc`` descendants, ``setsid`` and
  ``nohup`` children included (:mod:`.sandbox_procs`).

Isolation (``isolation=``), detected when the provider is built:

``bwrap``
    bubblewrap (Debian: ``apt-get install -y bubblewrap``): the file system is read-only except the
    sandbox's ``work`` and ``home``; ``/tmp`` is private; own network (only a loopback), PID, IPC
    and UTS namespaces; all capabilities dropped; killed when the host dies.
``netns``
    ``unshare -n`` (no bubblewrap): no network but the loopback; the file system is protected by
    the sandbox's user and file permissions only.
``none``
    neither works: user, environment, limits and process-tree kill only; the network is open.

Anything weaker than ``bwrap`` with a per-sandbox user is named in a warning when the provider is
built and in :attr:`LocalSandboxProvider.enforced` (the host records it in each trajectory's
metadata). A black-box agent reaches the router through :meth:`LocalSandbox.bridge`: inside the
network namespace, its endpoint's port on ``127.0.0.1`` leads to the router and nowhere else.

A provider sweeps the sandboxes that dead runs left under its root when it is built
(:mod:`.sandbox_registry`), and ``max_concurrent_sandboxes`` bounds how many of its own exist at once.

This module holds the provider (:class:`LocalSandboxProvider`); the per-trajectory object is in
:mod:`.sandbox_box` and the isolation probing and command line in :mod:`.sandbox_isolation`. Their
public names stay importable from here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pwd
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from loongsage_hookspecs import sandbox_request

from .sandbox_box import SHELL, LocalSandbox
from .sandbox_errors import SandboxError
from .sandbox_isolation import (
    ISOLATIONS,
    LAUNCHER,
    bwrap_problem,
    command_line,
    detect_isolation,
    launcher_python,
    unshare_flags,
)
from .sandbox_mounts import program_paths
from .sandbox_prepare import SnapshotError, chown_tree, materialize
from .sandbox_registry import Registry, UidPool, force_rmtree

__all__ = ["DEFAULT_ROOT", "ISOLATIONS", "LAUNCHER", "LocalSandbox", "LocalSandboxProvider", "SandboxError",
           "detect_isolation", "launcher_python"]

log = logging.getLogger(__name__)

DEFAULT_ROOT = os.path.join(tempfile.gettempdir(), "loongsage-sandboxes")


class LocalSandboxProvider:
    """Creates :class:`LocalSandbox` directories under ``root`` (see the module docstring).

    Args:
        root: parent directory of the sandbox directories (default ``<tmp>/loongsage-sandboxes``).
        isolation: ``auto``, ``bwrap``, ``netns`` or ``none``; asking for one that does not work
            here is an error.
        network: allow network access (no network namespace).
        cpu_time_s, memory_mb, file_size_mb, max_open_files, max_processes: resource limits per
            program (``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``,
            ``RLIMIT_NPROC`` counted on top of what the program's user already runs); 0 = unlimited.
        default_timeout_s: wall-clock limit of a command without its own timeout.
        trajectory_timeout_s: wall-clock budget of all the agent's commands and programs in one
            sandbox (0: none).
        max_output_bytes: stdout and stderr kept per command (each).
        run_as_user: ``"auto"``: when the host is root, a uid of its own per sandbox from
            ``uid_base``; a user name: that user for every sandbox; ``None``: the host's user.
        uid_base, uid_count: the pool of sandbox uids.
        env: environment variables of every command.
        base_dir: what relative ``sandbox.snapshot`` paths of rows are resolved against
            (default: the working directory).
        setup_timeout_s: wall-clock limit of each of a row's ``sandbox.setup`` commands (the row's
            ``setup_timeout_s`` wins).
        setup_network: let setup commands use the network (e.g. ``pip install``).
        max_concurrent_sandboxes: how many sandboxes of this provider exist at once (0: no bound);
            ``create`` waits for a free slot.
    """

    def __init__(self, root: str | None = None, isolation: str = "auto", network: bool = False,
                 cpu_time_s: int = 60, memory_mb: int = 2048, file_size_mb: int = 256, max_open_files: int = 1024,
                 max_processes: int = 256, default_timeout_s: float = 60.0, trajectory_timeout_s: float = 0,
                 max_output_bytes: int = 1_000_000, run_as_user: str | None = "auto", uid_base: int = 1_700_000,
                 uid_count: int = 4096, env: dict[str, str] | None = None, base_dir: str | None = None,
                 setup_timeout_s: float = 600.0, setup_network: bool = False,
                 max_concurrent_sandboxes: int = 0) -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"local sandbox: isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
        root_host = os.geteuid() == 0
        self.user: pwd.struct_passwd | None = None
        self.pool: UidPool | None = None
        probe_uid: int | None = None
        if root_host and run_as_user == "auto":
            self.pool = UidPool(uid_base, uid_count)
            # detection runs as an unprivileged uid too, one outside the pool (whose uids' processes
            # are killed whenever a sandbox takes or gives one back)
            probe_uid = int(uid_base) - 1
        elif root_host and run_as_user:
            try:
                self.user = pwd.getpwnam(run_as_user)
            except KeyError:
                raise SandboxError(f"local sandbox: run_as_user {run_as_user!r} does not exist") from None
            probe_uid = self.user.pw_uid
        probe_gid = self.user.pw_gid if self.user else probe_uid
        found = detect_isolation(probe_uid, probe_gid)
        self._bwrap_problem = bwrap_problem(probe_uid, probe_gid)
        if isolation == "auto":
            isolation = found
        elif isolation == "bwrap" and found != "bwrap":
            raise SandboxError(f"local sandbox: isolation='bwrap' but {self._bwrap_problem}")
        elif isolation == "netns" and found == "none":
            raise SandboxError("local sandbox: isolation='netns' but 'unshare -n' is not permitted here")
        self.isolation = isolation
        self.python = launcher_python(probe_uid, probe_gid)
        self.launcher_paths = program_paths([self.python])  # the launcher's interpreter, wherever it lives
        self.network = bool(network)
        self._unshare = unshare_flags(probe_uid, probe_gid) if isolation == "netns" else None
        self.root = os.path.abspath(root) if root else DEFAULT_ROOT
        self.rlimits = {name: value for name, value in (
            ("RLIMIT_CPU", int(cpu_time_s)), ("RLIMIT_AS", int(memory_mb) * 1024 * 1024),
            ("RLIMIT_FSIZE", int(file_size_mb) * 1024 * 1024), ("RLIMIT_NOFILE", int(max_open_files))) if value > 0}
        self.max_processes = int(max_processes)
        self.default_timeout_s = float(default_timeout_s)
        self.trajectory_timeout_s = float(trajectory_timeout_s or 0)
        self.max_output_bytes = int(max_output_bytes)
        self.extra_env = {str(k): str(v) for k, v in (env or {}).items()}
        self.base_dir = os.path.abspath(base_dir) if base_dir else None
        self.setup_timeout_s = float(setup_timeout_s)
        self.setup_network = bool(setup_network)
        self.max_concurrent = int(max_concurrent_sandboxes)
        self._slots: asyncio.Semaphore | None = None
        self._sandboxes: dict[str, LocalSandbox] = {}
        self.live = 0
        self.peak_live = 0
        self.registry: Registry | None = None
        self.swept: list[str] = []
        """The directories dead runs had left, removed before this provider's first sandbox."""
        self.launcher = LAUNCHER
        self.warnings = self._weaknesses()
        for line in self.warnings:
            log.warning("local sandbox: %s", line)

    # ------------------------------------------------------------------ what is in force
    @property
    def netns_for_programs(self) -> bool:
        return not self.network and self.isolation in ("bwrap", "netns")

    def _weaknesses(self) -> list[str]:
        out = []
        if self.isolation != "bwrap":
            why = self._bwrap_problem or f"isolation = '{self.isolation}' was asked for"
            out.append(f"{why}; running with the weaker isolation '{self.isolation}': the file "
                       "system outside the sandbox is protected by user permissions only"
                       + ("" if self.isolation == "netns" else ", and the network is open"))
        if os.geteuid() != 0:
            out.append("the host is not root, so programs run as the host's own user (no per-sandbox user; "
                       "the host's files are as exposed as the user's permissions allow)")
        elif self.pool is None and self.user is None:
            out.append("run_as_user = none on a root host: programs run as root")
        return out

    @property
    def enforced(self) -> dict[str, Any]:
        """What this provider actually enforces on this machine (recorded in the run's trajectories)."""
        if self.pool is not None:
            user = f"own uid per sandbox (from {self.pool.base})"
        else:
            user = self.user.pw_name if self.user else pwd.getpwuid(os.geteuid()).pw_name
        return {
            "isolation": self.isolation,
            "filesystem": "read-only outside the sandbox directory" if self.isolation == "bwrap"
            else "user permissions only",
            "network": "allowed" if self.network or self.isolation == "none" else "blocked",
            "router_bridge": self.netns_for_programs,
            "user": user,
            "limits": {**self.rlimits, "RLIMIT_NPROC": self.max_processes,
                       "command_timeout_s": self.default_timeout_s,
                       "trajectory_timeout_s": self.trajectory_timeout_s or None,
                       "max_output_bytes": self.max_output_bytes},
            "max_concurrent_sandboxes": self.max_concurrent or None,
            "warnings": list(self.warnings),
        }

    # ------------------------------------------------------------------ pieces used by programs
    def argv(self, box: LocalSandbox, argv: list[str], *, bridge: dict[str, Any] | None = None,
             network: bool | None = None, read_only: Sequence[str] = ()) -> list[str]:
        """The full command line of ``argv`` in ``box``: isolation, then the launcher, then ``argv``
        (``read_only``: host paths the program needs, visible read-only in the sandbox)."""
        return command_line(argv, isolation=self.isolation, python=self.python, launcher=self.launcher,
                            unshare=self._unshare, rlimits=self.rlimits, nproc=self.max_processes,
                            sandbox_dir=box.path, workdir=box.workdir, home=box.home,
                            network=self.network if network is None else network, bridge=bridge,
                            read_only=[*self.launcher_paths, *read_only])

    def base_env(self, box: LocalSandbox) -> dict[str, str]:
        tmp = "/tmp" if self.isolation == "bwrap" else os.path.join(box.home, "tmp")
        return {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "HOME": box.home, "TMPDIR": tmp,
                "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", **self.extra_env}

    def user_kwargs(self, box: LocalSandbox) -> dict[str, Any]:
        if box.uid is None:
            return {}
        return {"user": box.uid, "group": box.gid, "extra_groups": []}

    def _check_reachable(self, root: str, uid: int | None, gid: int | None) -> None:
        """Commands run as the sandbox user must be able to enter ``root``: check every parent."""
        if uid is None:
            return
        path = Path(root).resolve()
        for part in [path, *path.parents]:
            st = part.stat()
            bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == gid else 0o001
            if not st.st_mode & bit:
                raise SandboxError(f"local sandbox: the sandbox user (uid {uid}) cannot enter {part} (mode "
                                   f"{oct(st.st_mode & 0o777)}), so sandboxes under {root} would not work; pick a "
                                   f"'root' it can reach or set run_as_user = none")

    def _ensure_registry(self) -> Registry:
        if self.registry is None:
            os.makedirs(self.root, exist_ok=True)
            self.registry = Registry(self.root)
            # the launcher where every sandbox user can read it (the package may sit under a private home)
            self.launcher = os.path.join(self.root, f".launch-{self.registry.owner}.py")
            shutil.copyfile(LAUNCHER, self.launcher)
            os.chmod(self.launcher, 0o644)
            self.swept = self.registry.sweep(self.pool.sweep_free if self.pool is not None else None)
        return self.registry

    def sweep(self) -> list[str]:
        """Remove what dead runs left under ``root`` now (done anyway before the provider's first
        sandbox); returns the directories removed."""
        if self.registry is None:
            self._ensure_registry()
            return list(self.swept)
        return self.registry.sweep(self.pool.sweep_free if self.pool is not None else None)

    # ------------------------------------------------------------------ provider API
    async def create(self, trajectory_id: str, row: Mapping[str, Any] | None = None) -> LocalSandbox:
        """A sandbox for ``trajectory_id`` prepared from ``row`` (its snapshot, setup and env)."""
        try:
            request = sandbox_request(row, where=f"trajectory {trajectory_id}")
        except ValueError as exc:
            raise SandboxError(str(exc)) from None
        if self.max_concurrent > 0:
            if self._slots is None:
                self._slots = asyncio.Semaphore(self.max_concurrent)
            await self._slots.acquire()
        self.live += 1
        self.peak_live = max(self.peak_live, self.live)
        box: LocalSandbox | None = None
        uid: int | None = None
        try:
            registry = self._ensure_registry()
            if self.pool is not None:
                uid = self.pool.acquire()
            elif self.user is not None:
                uid = self.user.pw_uid
            gid = uid if self.pool is not None else (self.user.pw_gid if self.user else None)
            self._check_reachable(self.root, uid, gid)
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in trajectory_id)[:48]
            path = tempfile.mkdtemp(prefix=f"{registry.prefix()}{safe}-", dir=self.root)
            os.chmod(path, 0o711 if uid is not None else 0o700)
            marker = f"{registry.owner}/{os.path.basename(path)}"
            box = LocalSandbox(self, trajectory_id, os.path.realpath(path), uid, gid, marker, request.env)
            box.pooled_uid = uid if self.pool is not None else None
            uid = None  # the box owns it now
            self._sandboxes[box.path] = box
            for sub in (box.workdir, box.home):
                os.mkdir(sub, 0o700)
            os.mkdir(os.path.join(box.home, "tmp"), 0o700)
            try:
                await asyncio.to_thread(materialize, request, box.workdir, self.base_dir)
            except SnapshotError as exc:
                raise SandboxError(f"trajectory {trajectory_id}: {exc}") from None
            if box.uid is not None:
                for sub in (box.workdir, box.home):
                    await asyncio.to_thread(chown_tree, sub, box.uid, box.gid if box.gid is not None else -1)
            for command in request.setup:
                timeout = request.setup_timeout_s or self.setup_timeout_s
                done = await box.arun_program([SHELL, "-c", command], timeout_s=timeout,
                                              network=self.network or self.setup_network)
                if done.exit_code != 0:
                    why = f"timed out after {timeout:g}s" if done.timed_out else f"exited with status {done.exit_code}"
                    tail = (done.stderr or done.stdout).decode(errors="replace").strip()[-1000:]
                    raise SandboxError(f"trajectory {trajectory_id}: sandbox setup command {command!r} {why}: {tail}")
            if self.trajectory_timeout_s > 0:
                box.deadline = time.monotonic() + self.trajectory_timeout_s
            return box
        except BaseException:
            if box is not None:
                await asyncio.shield(self.destroy(box))
            else:
                if uid is not None and self.pool is not None:
                    self.pool.release(uid)
                self._release_slot()
            raise

    def _release_slot(self) -> None:
        self.live -= 1
        if self._slots is not None:
            self._slots.release()

    async def destroy(self, sandbox: LocalSandbox) -> None:
        """Kill everything the sandbox runs and delete its directory (idempotent)."""
        if sandbox.destroyed:
            return
        sandbox.destroyed = True
        try:
            await asyncio.to_thread(self._teardown, sandbox)
        finally:
            self._sandboxes.pop(sandbox.path, None)
            self._release_slot()

    def _teardown(self, sandbox: LocalSandbox) -> None:
        sandbox.kill_all()
        sandbox.close_bridges()
        force_rmtree(sandbox.path)
        if sandbox.pooled_uid is not None and self.pool is not None:
            self.pool.release(sandbox.pooled_uid)

    async def close(self) -> None:
        """Destroy every sandbox this provider still holds and give up its claim on ``root``."""
        for sandbox in list(self._sandboxes.values()):
            await self.destroy(sandbox)
        if self.registry is not None:
            self.registry.close()
            self.registry = None
            try:
                os.unlink(self.launcher)
            except OSError:
                pass
