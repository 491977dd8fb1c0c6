"""Processes of the ``local`` sandbox: finding them by marker, killing whole trees, capped output.

A sandbox's processes are found by what they cannot shed:

* their user: when the host is root, every sandbox runs as its own unprivileged uid
  (:mod:`.sandbox_users`), and ``kill(-1)`` sent *as that uid* reaches every process of it,
  ``setsid``/``nohup``/double-forked ones included, even while a fork bomb keeps spawning;
* a marker in their environment (``LOONGSAGE_SANDBOX=<sandbox>:<command>``), inherited by every
  child that does not scrub its environment on purpose, plus the process group and the
  descendants of the command (``/proc``), for hosts that cannot switch users.

:func:`run_capped` runs one program with a wall-clock limit and keeps only the first bytes of
its output while reading it (the rest is read and dropped, so the writer never blocks and the
host never buffers more than the cap).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterable, Iterator

import attrs

MARKER = "LOONGSAGE_SANDBOX"


@attrs.define
class ProcInfo:
    pid: int
    ppid: int
    pgid: int
    uid: int


def processes() -> Iterator[ProcInfo]:
    """Every live process visible in ``/proc`` (pid, parent, process group, real uid)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/status", encoding="ascii", errors="replace") as f:
                uid_line = next(line for line in f if line.startswith("Uid:"))
            uid = int(uid_line.split()[1])  # the real uid (the owner of /proc/<pid> may read as root)
        except (OSError, IndexError, StopIteration, ValueError):
            continue
        if fields[0] == "Z":  # zombies hold nothing; their parent reaps them
            continue
        yield ProcInfo(pid=int(entry), ppid=int(fields[1]), pgid=int(fields[2]), uid=uid)


def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return any(item.startswith(needle) for item in data.split(b"\0"))


def marked(prefix: str, procs: Iterable[ProcInfo] | None = None) -> list[int]:
    """Pids whose environment holds ``LOONGSAGE_SANDBOX=<prefix>...``."""
    needle = f"{MARKER}={prefix}".encode()
    me = os.getpid()
    return [p.pid for p in (procs if procs is not None else processes()) if p.pid != me and _environ_has(p.pid, needle)]


def with_argument(text: str) -> list[int]:
    """Pids of live processes whose command line contains ``text`` (a marker a test or an operator
    put in a command's arguments, e.g. ``sleep 31.0042``), zombies left out."""
    found = []
    for p in processes():
        try:
            with open(f"/proc/{p.pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(p.pid)
        except OSError:
            continue
    return found


def descendants(root_pids: Iterable[int], procs: list[ProcInfo]) -> list[int]:
    """Every process below ``root_pids`` (by parent links), wherever its process group is."""
    children: dict[int, list[int]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p.pid)
    out, todo = [], list(root_pids)
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


KILL_DEADLINE_S = 30.0
"""How long :func:`kill_tree` and :func:`kill_uid` keep killing before giving up. A killed process
stays listed until the scheduler runs its exit; on a loaded machine a fork bomb's hundreds of
processes take seconds to go, so the bound is time, not a number of rounds."""


def _until_deadline(seconds: float) -> Iterator[None]:
    """Yield until ``seconds`` have passed, pausing a little longer each time (10 ms to 50 ms)."""
    deadline = time.monotonic() + seconds
    pause = 0.01
    while True:
        yield
        if time.monotonic() >= deadline:
            return
        time.sleep(pause)
        pause = min(pause * 1.5, 0.05)


def kill_tree(pid: int | None, marker: str | None, *, deadline_s: float = KILL_DEADLINE_S) -> None:
    """SIGKILL the process group of ``pid``, its descendants and every process carrying ``marker``,
    repeating until none is left (a process may fork while it is being killed)."""
    seen: set[int] = {pid} if pid else set()  # once found, followed even after it is reparented
    for _ in _until_deadline(deadline_s):
        procs = list(processes())
        live = {p.pid for p in procs}
        victims = (seen & live) | set(descendants(seen, procs))
        if pid:
            victims |= {p.pid for p in procs if p.pgid == pid}
        if marker:
            victims |= set(marked(marker, procs))
        victims.discard(os.getpid())
        if not victims:
            return
        seen |= victims
        _kill(victims)


def uid_processes(uid: int) -> list[int]:
    return [p.pid for p in processes() if p.uid == uid]


_KILL_ALL = "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n    pass\n"


def kill_uid(uid: int, *, deadline_s: float = KILL_DEADLINE_S) -> bool:
    """Kill every process of ``uid`` (the host must be root): ``kill(-1, SIGKILL)`` sent as that
    uid, repeated until ``/proc`` shows none. Returns whether none is left."""
    for _ in _until_deadline(deadline_s):
        if not uid_processes(uid):
            return True
        try:
            subprocess.run([sys.executable, "-I", "-S", "-c", _KILL_ALL], user=uid, group=uid, extra_groups=[],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           cwd="/", env={}, timeout=10)
        except (OSError, subprocess.SubprocessError):
            _kill(uid_processes(uid))
    return not uid_processes(uid)


@attrs.define
class Completed:
    """What :func:`run_capped` saw: exit status, the kept output, and whether it timed out / was cut."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    truncated: bool = False


class _CappedReader(threading.Thread):
    """Reads a pipe to its end, keeping the first ``limit`` bytes and dropping the rest."""

    def __init__(self, fd: int, limit: int) -> None:
        super().__init__(daemon=True)
        self.fd, self.limit = fd, limit
        self.buf = bytearray()
        self.truncated = False

    def run(self) -> None:
        try:
            while True:
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    return
                room = self.limit - len(self.buf)
                if room > 0:
                    self.buf.extend(chunk[:room])
                if len(chunk) > max(room, 0):
                    self.truncated = True
        except OSError:
            return
        finally:
            os.close(self.fd)


class Launch:
    """One started program: :meth:`wait` collects it; :meth:`kill` takes its whole tree down."""

    def __init__(self, argv: list[str], *, env: dict[str, str], cwd: str, marker: str, stdin: bytes | None,
                 max_output_bytes: int, user_kwargs: dict[str, Any]) -> None:
        self.marker = marker
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                argv, cwd=cwd, env={**env, MARKER: marker}, start_new_session=True, close_fds=True,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL, stdout=out_w, stderr=err_w,
                **user_kwargs)
        except BaseException:
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            raise
        os.close(out_w)
        os.close(err_w)
        self.readers = [_CappedReader(out_r, max_output_bytes), _CappedReader(err_r, max_output_bytes)]
        for r in self.readers:
            r.start()
        if stdin is not None:
            threading.Thread(target=self._feed, args=(stdin,), daemon=True).start()
        self.killed = False

    def _feed(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(data)
        except OSError:
            pass
        finally:
            try:
                self.proc.stdin.close()
            except OSError:
                pass

    def kill(self) -> None:
        self.killed = True
        kill_tree(self.proc.pid, self.marker)

    def wait(self, timeout_s: float | None, *, linger_s: float = 1.0) -> Completed:
        """Wait up to ``timeout_s``; past it the whole tree is killed. After the program exits,
        output still held open by processes it left behind is read for ``linger_s`` more."""
        timed_out = False
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            self.kill()
            self.proc.wait()
        deadline = time.monotonic() + linger_s
        for r in self.readers:
            r.join(max(0.0, deadline - time.monotonic()))
        code = self.proc.returncode
        out, err = (bytes(r.buf) for r in self.readers)
        return Completed(exit_code=124 if timed_out else (code if code is not None else -1), stdout=out,
                         stderr=err, timed_out=timed_out, truncated=any(r.truncated for r in self.readers))


async def await_launch(start: Callable[[], "Launch | Completed"], timeout: float | None,
                       finish: Callable[[Launch], None] | None = None, name: str = "sandbox") -> Completed:
    """Start a program with ``start`` and wait for it (``Launch.wait(timeout)``) in a thread of its
    own, so the event loop never blocks on it; cancelling the awaiting task kills its whole tree.
    ``start`` may return a :class:`Completed` right away (a refusal); ``finish`` runs after the wait."""
    holder: dict[str, Launch] = {}
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Completed] = loop.create_future()

    def settle(result: Completed | None, error: BaseException | None) -> None:
        if not future.done():
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)  # type: ignore[arg-type]

    def work() -> None:
        result: Completed | None = None
        error: BaseException | None = None
        try:
            started = start()
            if isinstance(started, Completed):
                result = started
            else:
                holder["launch"] = started
                if future.done():  # cancelled while starting
                    started.kill()
                try:
                    result = started.wait(timeout)
                finally:
                    if finish is not None:
                        finish(started)
        except BaseException as exc:  # handed to the awaiting task
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=work, name=name, daemon=True).start()
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.cancel()
        launch = holder.get("launch")
        if launch is not None:
            await asyncio.to_thread(launch.kill)
        raise
