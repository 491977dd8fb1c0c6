"""Running out of the machine is one line saying what to change: an actor Ray's memory monitor
killed, a Ray cluster that cannot be reached (real runs through the CLI)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


def run_cli(job, out, *overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loongsage_core", "run", str(job), "--output-dir", str(out),
                           *overrides], capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


def test_an_actor_killed_for_memory_ends_the_run_in_one_line_saying_what_to_change(tiny_job, tmp_path):
    # Ray's memory monitor kills a worker once the node uses more than this share of its memory:
    # 1% is below what any machine running this test uses, so the first model actor is killed
    done = run_cli(tiny_job.write(tmp_path), tmp_path / "run", "train.total_steps=1",
                   env={"RAY_memory_usage_threshold": "0.01", "RAY_memory_monitor_refresh_ms": "100"})
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert last.startswith("loongsage: error: a model actor was killed for lack of memory: "), last
    assert "were killed due to the node running low on memory" in last and "OOM kill reason: " in last, last
    assert "train.micro_batch_size" in last and "RAY_memory_usage_threshold" in last, last


def test_a_ray_address_where_nothing_listens_is_one_line_at_once(tiny_job, tmp_path):
    with socket.socket() as free:  # a port nobody listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    t0 = time.monotonic()
    done = run_cli(tiny_job.write(tmp_path), tmp_path / "run", f"run.ray_address=127.0.0.1:{port}")
    assert done.returncode == 1, done.stderr[-3000:]
    assert time.monotonic() - t0 < 120  # Ray alone would keep retrying for minutes
    (line,) = done.stderr.strip().splitlines()
    assert line == (f"loongsage: error: cannot join the Ray cluster at '127.0.0.1:{port}' (run.ray_address or "
                    "RAY_ADDRESS): [Errno 111] Connection refused; start it there (`ray start --head`) or fix the "
                    "address"), line
