"""What isolation the ``local`` sandbox can use on this machine, and the command line that applies it.

Probing (cached, run once per uid): whether bubblewrap works, whether ``unshare -n`` gives a network
namespace (directly or through a user namespace), and which Python interpreter the sandbox's user
may run :mod:`.sandbox_launch` with. :func:`command_line` then wraps a program in the chosen mode
(``bwrap``, ``netns`` or ``none``) and in the launcher that applies the limits and the router bridge.

Split out of :mod:`.local_sandbox` so the kernel-facing part (what works here, which flags follow
from it) reads on its own; the provider only decides which mode to use (see its module docstring).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any, Sequence

from .sandbox_errors import SandboxError

ISOLATIONS = ("auto", "bwrap", "netns", "none")
LAUNCHER = str(Path(__file__).with_name("sandbox_launch.py"))


@cache
def _probe(argv: tuple[str, ...], uid: int | None = None, gid: int | None = None) -> str | None:
    """``None`` when ``argv`` runs and exits 0 here as ``uid``, else why not (the end of its error
    output); cached: used to detect isolation support."""
    kwargs: dict[str, Any] = {} if uid is None else {"user": uid, "group": gid, "extra_groups": []}
    try:
        done = subprocess.run(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd="/",
                              stderr=subprocess.PIPE, timeout=20, **kwargs)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if done.returncode == 0:
        return None
    said = done.stderr.decode(errors="replace").strip().splitlines()
    return f"exit status {done.returncode}" + (f": {said[-1][:300]}" if said else "")


def _works(argv: tuple[str, ...], uid: int | None = None, gid: int | None = None) -> bool:
    """Whether ``argv`` runs and exits 0 here as ``uid``."""
    return _probe(argv, uid, gid) is None


def bwrap_problem(uid: int | None = None, gid: int | None = None) -> str | None:
    """Why bubblewrap cannot isolate commands run as ``uid`` here, ``None`` when it can: not
    installed, or installed but failing (e.g. no user namespaces in a container), with its error."""
    bwrap = shutil.which("bwrap")
    if not bwrap:
        return "bubblewrap is not installed (apt-get install -y bubblewrap)"
    failed = _probe((bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--unshare-net", "--cap-drop", "ALL",
                     "--die-with-parent", "true"), uid, gid)
    if failed is None:
        return None
    who = "" if uid is None else f" as uid {uid}"
    return f"bubblewrap ({bwrap}) is installed but does not work here{who}: {failed}"


def detect_isolation(uid: int | None = None, gid: int | None = None) -> str:
    """The strongest isolation that works here for commands run as ``uid``: ``bwrap``, ``netns`` or ``none``."""
    if bwrap_problem(uid, gid) is None:
        return "bwrap"
    if unshare_flags(uid, gid) is not None:
        return "netns"
    return "none"


def unshare_flags(uid: int | None, gid: int | None) -> list[str] | None:
    """How ``unshare`` gives ``uid`` a network namespace here (``-n``, or ``-n -r`` through a user
    namespace), or ``None`` if it cannot."""
    unshare = shutil.which("unshare")
    if not unshare:
        return None
    for flags in (["-n"], ["-n", "-r"]):
        if _works((unshare, *flags, "true"), uid, gid):
            return flags
    return None


def launcher_python(uid: int | None, gid: int | None) -> str:
    """A Python interpreter the sandbox's user can run (the host's may live under a private home)."""
    candidates = [sys.executable, os.path.realpath(sys.executable), shutil.which("python3"), "/usr/bin/python3",
                  "/usr/local/bin/python3"]
    for candidate in dict.fromkeys(c for c in candidates if c):
        if _works((candidate, "-I", "-S", "-c", "import json, resource, socket, subprocess"), uid, gid):
            return candidate
    raise SandboxError(f"local sandbox: no Python interpreter that the sandbox user (uid {uid}) may run; tried "
                       f"{', '.join(c for c in candidates if c)}")



def command_line(argv: list[str], *, isolation: str, python: str, launcher: str, unshare: list[str] | None,
                 rlimits: dict[str, int], nproc: int, sandbox_dir: str, workdir: str, home: str, network: bool,
                 bridge: dict[str, Any] | None, read_only: Sequence[str] = ()) -> list[str]:
    """The full command line of ``argv``: the isolation's prefix, then the launcher (with its
    limits and bridge settings as JSON), then ``argv``.

    ``bwrap`` sees the host read-only but for ``workdir`` and ``home`` (``sandbox_dir`` read-only),
    a private ``/tmp``, its own PID, IPC, UTS (and, without ``network``, network) namespaces and no
    capabilities; ``netns`` runs under ``unshare`` with the ``unshare`` flags probed for it.
    ``read_only``: host paths the program needs (the launcher's Python, a CLI's install, node),
    mounted read-only where they are, so they are there even under the private ``/tmp`` (a
    checkout, a virtual environment or a CLI install under ``/tmp``).
    """
    config: dict[str, Any] = {"rlimits": rlimits, "nproc": nproc or None}
    prefix: list[str] = []
    if isolation == "bwrap":
        mounts = [arg for path in dict.fromkeys([python, *read_only]) if os.path.exists(path)
                  for arg in ("--ro-bind", path, path)]
        prefix = [shutil.which("bwrap") or "bwrap", "--ro-bind", "/", "/", "--tmpfs", "/tmp",
                  "--ro-bind", launcher, launcher, *mounts, "--ro-bind", sandbox_dir, sandbox_dir,
                  "--bind", workdir, workdir,
                  "--bind", home, home, "--dev", "/dev", "--proc", "/proc",
                  "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session",
                  "--cap-drop", "ALL", "--chdir", workdir]
        if not network:
            prefix.append("--unshare-net")
        prefix.append("--")
    elif isolation == "netns" and not network and unshare is not None:
        prefix = [shutil.which("unshare") or "unshare", *unshare, "--"]
        config["loopback_up"] = True
    if bridge and not network:
        config["bridge"] = bridge
    return [*prefix, python, "-I", "-S", launcher, json.dumps(config), *argv]
