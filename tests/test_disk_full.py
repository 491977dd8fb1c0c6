"""A full disk: the run stops with one line naming the file it could not write and the free space,
and the last intact checkpoint stays ``latest`` (resumable); rollout records that find no room are
one logged line and training goes on. The disk is a small tmpfs mounted for the test in a mount
namespace of its own (``unshare``: as root, or in a user namespace otherwise), so the run's
driver, its Ray cluster and its actors all see it and nothing else does."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

from loongsage_core.run_files.checkpoint import verify


def in_small_tmpfs(size_kib: int, mountpoint: Path, command: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the shell ``command`` with a ``size_kib`` KiB tmpfs mounted on ``mountpoint`` (seen by it alone)."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    unshare = (["unshare", "--mount", "--propagation", "private"] if os.geteuid() == 0
               else ["unshare", "--user", "--map-root-user", "--mount"])
    script = f"mount -t tmpfs -o size={size_kib}k tmpfs {shlex.quote(str(mountpoint))} && {command}"
    return subprocess.run([*unshare, "sh", "-c", script], capture_output=True, text=True, timeout=timeout)


def test_a_checkpoint_that_finds_no_room_stops_the_run_in_one_line_and_keeps_latest(tiny_job, tmp_path):
    job = tiny_job.write(tmp_path)
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    out = disk / "run"
    # one checkpoint of the tiny model is ~480 KiB: the first fits in 700 KiB, the second does not
    run = shlex.join([sys.executable, "-m", "loongsage_core", "run", str(job), "--output-dir", str(out),
                      "train.total_steps=3", "run.checkpoint_every=1", "run.keep_checkpoints=0"])
    done = in_small_tmpfs(700, disk, f"{run}; rc=$?; cp -r {shlex.quote(str(out / 'checkpoints'))} "
                                     f"{shlex.quote(str(kept))}; exit $rc")
    assert done.returncode == 1, done.stderr[-3000:]
    # Ray's own daemons may log after the run's last line (a host disk nearly full): not the run's output
    last = [line for line in done.stderr.strip().splitlines() if "(raylet)" not in line][-1]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    target = out / "checkpoints" / "step_000002" / "trainer" / "trainer_state.pt"
    assert last.startswith(f"loongsage: error: cannot write '{target}': no space left on device ("), last
    assert " KiB free of 700.0 KiB); the last intact checkpoint, step 1, stays 'latest'" in last, last
    # the checkpoint of step 1 is intact and still the one a resume takes; the failed one left no temporary file
    assert (kept / "latest").read_text().strip() == "step_000001"
    assert verify(kept / "step_000001") is None
    assert not list((kept / "step_000002").rglob("*.tmp"))


RECORDS = textwrap.dedent("""
    import json, logging, sys
    from pathlib import Path
    from transformers import AutoTokenizer
    from loongsage_core.records.writer import RolloutRecorder
    from loongsage_hookspecs import Segment, Trajectory, TrajectoryGroup, TrajectoryStatus

    disk, tokenizer = Path(sys.argv[1]), AutoTokenizer.from_pretrained(sys.argv[2])
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("loongsage").addHandler(handler)
    (disk / "ballast").write_bytes(b"x" * (56 << 10))  # the rest of the 64 KiB is too little for a step
    recorder = RolloutRecorder(disk / "run", tokenizer)
    group = TrajectoryGroup(group_id="0:0", prompt_id="p", source="s")
    for i in range(16):
        seg = Segment()
        seg.append(list(range(3, 200)), generated=False)
        seg.append(list(range(200, 500)), generated=True, logprobs=[-1.0] * 300, weight_version=0)
        group.trajectories.append(Trajectory(id=f"t{i}", prompt_id="p", group_id="0:0", source="s",
                                             prompt="x" * 4000, segments=[seg], status=TrajectoryStatus.COMPLETED))
    recorder.add(0, [group], None, policy_version=0)
    recorder.close()
    left = sorted(p.name for p in (disk / "run" / "rollouts").iterdir())
    print(json.dumps({"lines": lines, "errors": recorder.errors, "left": left}))
""")


def test_records_that_find_no_room_are_one_logged_line_and_leave_nothing_behind(tmp_path):
    script = tmp_path / "records.py"
    script.write_text(RECORDS)
    disk = tmp_path / "disk"
    tokenizer = Path(__file__).parent / "data" / "tokenizer"
    done = in_small_tmpfs(64, disk, shlex.join([sys.executable, str(script), str(disk), str(tokenizer)]), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    target = disk / "run" / "rollouts" / "step_000000.jsonl.gz"
    (line,) = result["lines"]
    assert line.startswith(f"rollout records of step 0 not written: cannot write '{target}': no space left on "
                           "device (") and line.endswith("; training goes on"), line
    assert result["errors"] == 1 and result["left"] == []  # no half-written file takes the room
