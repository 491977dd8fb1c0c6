"""scripts/check_leaks.py: processes that outlive a test run are found by the run's mark, reported, killed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_leaks.py"


def check(mark: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), mark, "--grace-s", "1", *extra], capture_output=True,
                          text=True, timeout=120)


def test_a_marked_process_left_behind_fails_the_check_and_is_killed():
    mark = f"test-{uuid.uuid4().hex}"
    # a new session, like an engine server: it is no child of the run any more once re-parented
    leaked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True,
                              env={**os.environ, "LOONGSAGE_RUN_MARK": mark})
    try:
        kept = check(mark, "--keep")
        assert kept.returncode == 1 and f"pid {leaked.pid}" in kept.stderr and "LEAK CHECK FAILED" in kept.stderr
        assert leaked.poll() is None  # --keep reports only
        done = check(mark)
        assert done.returncode == 1 and f"pid {leaked.pid}" in done.stderr
        assert leaked.wait(timeout=30) == -9  # killed, so the next run starts clean
    finally:
        if leaked.poll() is None:
            leaked.kill()
            leaked.wait()


def test_a_run_that_left_nothing_passes_and_other_marks_do_not_count():
    mark = f"test-{uuid.uuid4().hex}"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                             env={**os.environ, "LOONGSAGE_RUN_MARK": mark + "-other"})
    try:
        started = time.monotonic()
        done = check(mark)
        assert done.returncode == 0, done.stderr
        assert "no process of the run" in done.stdout and time.monotonic() - started < 60
        assert other.poll() is None  # a process of another run is not touched
    finally:
        other.kill()
        other.wait()
