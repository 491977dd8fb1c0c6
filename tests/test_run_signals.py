"""``loongsage run`` ends cleanly on SIGTERM and on SIGINT, even when started as a background job
(which starts with SIGINT ignored): exit status 130, "interrupted", and no engine, sandbox or Ray
process of the run left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_run_through_its_cleanup(tmp_path, tiny_job, stop):
    job = tiny_job.write(tmp_path)
    out = tmp_path / "run"
    mark = f"signals-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "LOONGSAGE_RUN_MARK": mark, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAY_ADDRESS", None)
    # a background job of a non-interactive shell: SIGINT ignored from the start
    proc = subprocess.Popen([sys.executable, "-m", "loongsage_core", "run", str(job), "--output-dir", str(out),
                             "train.total_steps=1000", "run.checkpoint_every=0"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 300
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):  # a step trained: mid-run
            assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "no step finished in 300 s"
            time.sleep(0.5)
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert "loongsage: interrupted" in err
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(len(steps))) and 0 < len(steps) < 1000
    leaks = subprocess.run([sys.executable, str(REPO / "scripts" / "check_leaks.py"), mark, "--grace-s", "30"],
                           capture_output=True, text=True)
    assert leaks.returncode == 0, leaks.stdout + leaks.stderr
