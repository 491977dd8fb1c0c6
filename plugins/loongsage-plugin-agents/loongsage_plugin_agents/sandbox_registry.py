"""Who owns which ``local`` sandbox on this machine, so that nothing outlives a killed run.

* Every provider holds an exclusive ``flock`` on ``<root>/.owners/<owner>.lock`` while it lives and
  names its sandbox directories ``<owner>--...``; the kernel drops the lock when the process dies,
  however it dies (``kill -9`` included).
* When the host is root, every sandbox runs as its own uid taken from a pool; a uid is held by a
  ``flock`` on ``<lock dir>/uid-<n>.lock`` for the sandbox's life, and whoever takes a uid first
  kills every process still running as it.

:meth:`Registry.sweep` (every new provider runs it, so a resumed or new run does) finds the
owners whose lock is free, kills what their sandboxes still run and deletes their directories.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
import tempfile
from typing import Callable

from .sandbox_procs import kill_tree, kill_uid

log = logging.getLogger(__name__)

UID_LOCK_DIR = os.path.join(tempfile.gettempdir(), "loongsage-sandbox-uids")


def _try_lock(path: str) -> int | None:
    """An fd holding an exclusive lock on ``path`` (created), or ``None`` if someone else holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


class UidPool:
    """Unprivileged uids for sandboxes, one per live sandbox machine-wide (``uid_base`` + n)."""

    def __init__(self, base: int, size: int, lock_dir: str = UID_LOCK_DIR) -> None:
        self.base, self.size, self.lock_dir = int(base), int(size), lock_dir
        os.makedirs(lock_dir, mode=0o700, exist_ok=True)
        self._held: dict[int, int] = {}

    def acquire(self) -> int:
        for uid in range(self.base, self.base + self.size):
            if uid in self._held:
                continue
            fd = _try_lock(os.path.join(self.lock_dir, f"uid-{uid}.lock"))
            if fd is None:
                continue
            kill_uid(uid)  # whatever a dead run left running as this uid
            self._held[uid] = fd
            return uid
        raise RuntimeError(f"local sandbox: all {self.size} sandbox uids from {self.base} are in use")

    def release(self, uid: int) -> None:
        kill_uid(uid)
        fd = self._held.pop(uid, None)
        if fd is not None:
            os.close(fd)

    def sweep_free(self, uid: int) -> None:
        """Kill ``uid``'s processes if no live sandbox holds it."""
        if uid in self._held or not self.base <= uid < self.base + self.size:
            return
        fd = _try_lock(os.path.join(self.lock_dir, f"uid-{uid}.lock"))
        if fd is not None:
            try:
                kill_uid(uid)
            finally:
                os.close(fd)


class Registry:
    """This provider's claim on ``root`` (see the module docstring)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.owners = os.path.join(root, ".owners")
        os.makedirs(self.owners, mode=0o700, exist_ok=True)
        os.chmod(root, 0o711)
        self.owner = f"{os.getpid()}-{secrets.token_hex(4)}"
        fd = _try_lock(os.path.join(self.owners, f"{self.owner}.lock"))
        assert fd is not None, "a fresh owner id is locked by someone else"
        self._fd: int | None = fd

    def prefix(self) -> str:
        return f"{self.owner}--"

    def sweep(self, sweep_uid: Callable[[int], None] | None) -> list[str]:
        """Delete the sandboxes of dead owners (killing what they still run); returns their paths.

        An owner is dead when its lock can be taken; each owner is judged when one of its
        directories is met, so a provider that starts meanwhile is never mistaken for a dead one
        (its lock exists before its first directory does)."""
        held: dict[str, int | None] = {self.owner: None}  # owner -> our fd on its lock (None: alive)
        removed: list[str] = []
        try:
            for entry in sorted(os.listdir(self.root)):
                if entry.startswith(".launch-") and entry.endswith(".py"):
                    owner = entry[len(".launch-"):-3]
                    if owner not in held:
                        held[owner] = _try_lock(os.path.join(self.owners, f"{owner}.lock"))
                    if held[owner] is not None:
                        os.unlink(os.path.join(self.root, entry))
                    continue
                owner = entry.split("--", 1)[0] if "--" in entry else None
                if owner is None:
                    continue
                if owner not in held:
                    held[owner] = _try_lock(os.path.join(self.owners, f"{owner}.lock"))
                if held[owner] is None:
                    continue
                path = os.path.join(self.root, entry)
                kill_tree(None, f"{owner}/")
                if sweep_uid is not None:
                    for sub in ("work", "home"):
                        try:
                            sweep_uid(os.stat(os.path.join(path, sub)).st_uid)
                        except OSError:
                            pass
                force_rmtree(path)
                removed.append(path)
            for name in os.listdir(self.owners):  # locks of owners that left no directory
                owner = name[:-5]
                if name.endswith(".lock") and owner not in held:
                    held[owner] = _try_lock(os.path.join(self.owners, name))
        finally:
            for owner, fd in held.items():
                if fd is not None:
                    try:
                        os.unlink(os.path.join(self.owners, f"{owner}.lock"))
                    except OSError:
                        pass
                    os.close(fd)
        if removed:
            log.warning("local sandbox: removed %d sandbox(es) that a run which ended without cleaning up left "
                        "under %s", len(removed), self.root)
        return removed

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.unlink(os.path.join(self.owners, f"{self.owner}.lock"))
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None


def force_rmtree(path: str) -> None:
    """Remove ``path`` even if the sandboxed program made parts of it read-only."""
    def retry(func: Callable[..., object], p: str, _: object) -> None:
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
