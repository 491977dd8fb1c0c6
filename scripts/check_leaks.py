"""Fail loudly when processes started by a test run outlive it (an engine server, a Ray session).

The run is started with ``LOONGSAGE_RUN_MARK=<mark>`` in its environment; every process it
starts inherits the variable (subprocesses, SGLang servers in their own sessions, Ray's
``gcs_server`` / ``raylet`` / workers), even after being re-parented once the run exits. This
script waits a little for them to exit (Ray shuts its processes down asynchronously), then lists
every process of this user that still carries the mark, kills them (by pid, so the next run
starts clean) and exits 1. Usage::

    LOONGSAGE_RUN_MARK=ci-123 .venv/bin/python -m pytest -q
    .venv/bin/python scripts/check_leaks.py ci-123 [--grace-s 30]

Standard library only, Linux (/proc).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

MARK_VAR = "LOONGSAGE_RUN_MARK"
RAY_NAMES = ("raylet", "gcs_server", "ray::", "dashboard", "log_monitor", "monitor.py", "default_worker.py",
             "runtime_env", "plasma")


def marked_processes(mark: str) -> dict[int, str]:
    """``{pid: command line}`` of this user's live processes whose environment carries ``mark``."""
    needle = f"{MARK_VAR}={mark}".encode()
    me, uid = os.getpid(), os.getuid()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            status = (entry / "status").read_text()
            if "\nState:\tZ" in status:  # a zombie holds nothing; its parent just has not reaped it
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        found[int(entry.name)] = cmd or f"[{(entry / 'comm').read_text().strip()}]"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mark", help=f"the value of ${MARK_VAR} the run was started with")
    parser.add_argument("--grace-s", type=float, default=30.0, help="how long leftovers may take to exit")
    parser.add_argument("--keep", action="store_true", help="report leftovers without killing them")
    args = parser.parse_args(argv)
    if not args.mark:
        parser.error("an empty mark would match every process")
    deadline = time.monotonic() + args.grace_s
    left = marked_processes(args.mark)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = marked_processes(args.mark)
    if not left:
        print(f"leak check: no process of the run ({MARK_VAR}={args.mark}) is left")
        return 0
    ray = {pid: cmd for pid, cmd in left.items() if any(name in cmd for name in RAY_NAMES)}
    print(f"LEAK CHECK FAILED: {len(left)} process(es) started by the test run are still alive "
          f"{args.grace_s:g} s after it ended ({len(ray)} of a Ray session):", file=sys.stderr)
    for pid, cmd in sorted(left.items()):
        label = "ray    " if pid in ray else "process"
        print(f"  {label} pid {pid}: {cmd[:300]}", file=sys.stderr)
    if not args.keep:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        print("  (killed them, so that the next run starts clean)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
