"""``kill -9`` of a run in the middle of its rollout, then resume: the resumed run sweeps every
sandbox directory and process the killed one left, and trains."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest
from loongsage_plugin_agents.sandbox_procs import with_argument

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="the per-sandbox user needs a root host"),
              pytest.mark.slow]  # programs in sandboxes (and, with kill and resume, whole runs)

# an agent that calls its endpoint once, leaves a detached process behind, and from the second
# step on (trajectory ids are "<step>-<prompt>-<sample>") hangs while FLAG exists
AGENT = """
import os, subprocess, time
from openai import OpenAI
OpenAI().chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
subprocess.Popen(["sleep", os.environ["MARKER"]], start_new_session=True)
while not os.environ["LOONGSAGE_TRAJECTORY_ID"].startswith("0-") and os.path.exists(os.environ["FLAG"]):
    time.sleep(0.2)
print(3)
"""


def _boxes(root: Path) -> list[str]:
    return sorted(e for e in os.listdir(root) if "--" in e) if root.exists() else []


@pytest.mark.parametrize("isolation", ["netns"])  # bubblewrap dies with its parent: netns is the harder case
def test_kill_9_mid_rollout_then_resume_leaves_no_sandbox_behind(tmp_path, isolation):
    from loongsage_plugin_agents.local_sandbox import LocalSandboxProvider

    # a place the sandbox users can reach (pytest's temp directory is private to root) and see
    # (bubblewrap gives them a /tmp of their own)
    visible = "/var/tmp" if os.path.isdir("/var/tmp") else None
    shared = Path(tempfile.mkdtemp(prefix="loongsage-kill-test-", dir=visible))
    os.chmod(shared, 0o755)
    root, flag, agent = shared / "boxes", shared / "hang", shared / "agent.py"
    agent.write_text(AGENT)
    os.chmod(agent, 0o644)
    flag.write_text("")
    os.chmod(flag, 0o644)
    marker = f"44.{os.getpid():07d}{time.monotonic_ns() % 1000:03d}"
    # sandbox uids of this test's own: a sandbox another test creates meanwhile takes the first free
    # uid of its pool and kills what a dead run left running as it, which would be this run's leftovers
    uid_base = 3_000_000 + (os.getpid() % 5000) * 16
    python = LocalSandboxProvider(isolation=isolation).python  # an interpreter the sandbox users may run
    env_vars = {"PYTHONPATH": sysconfig.get_paths()["purelib"], "MARKER": marker, "FLAG": str(flag)}
    env_table = "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in env_vars.items()) + " }"
    job = tmp_path / "job.toml"
    job.write_text(f"""
[plugins]
enable = ["torch", "rl", "rewards", "loggers", "agents"]
[model]
path = "{REPO / 'configs' / 'quickstart' / 'model'}"
[train]
lr = 2e-4
total_steps = 2
mini_batch_size = 2
micro_batch_size = 2
[rollout]
prompts_per_step = 1
samples_per_prompt = 2
max_new_tokens = 4
weight_transport = "inprocess"
[run]
checkpoint_every = 1
[agentflow]
agent_timeout_s = 300
[[data]]
name = "boxed"
generator = "arithmetic"
generator_args = {{ num_samples = 4, digits = 1, num_operands = 2, ops = "+" }}
agent = "command"
agent_args = {{ command = ["{python}", "{agent}"], stdin = false, env = {env_table} }}
sandbox = "local"
sandbox_args = {{ root = "{root}", isolation = "{isolation}", uid_base = {uid_base}, uid_count = 16 }}
reward = ["numeric_match"]
[[loggers]]
name = "jsonl"
""")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "loongsage_core", "run", str(job), "--output-dir", str(out)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        log = tmp_path / "first-run.log"
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=log.open("w"))
        deadline = time.monotonic() + 300
        try:  # kill hard once both trajectories of the second step sit in their sandboxes
            while time.monotonic() < deadline:
                if (out / "checkpoints" / "latest").exists() and len(_boxes(root)) == 2 \
                        and len(with_argument(marker)) == 2:
                    break
                assert proc.poll() is None, f"the run ended before it could be killed: {log.read_text()[-3000:]}"
                time.sleep(0.2)
            else:
                pytest.fail("the sandboxes never appeared")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        time.sleep(1)
        left = _boxes(root)
        assert len(left) == 2  # the kill left the directories behind...
        if isolation == "netns":  # ...and, outside bubblewrap (which dies with its parent), the processes
            assert len(with_argument(marker)) == 2
        flag.unlink()
        done = subprocess.run(cmd + ["run.resume=true"], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "removed 2 sandbox(es)" in done.stderr
        assert _boxes(root) == [] and with_argument(marker) == []
        metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [0, 1]
        m = metrics[1]
        assert m["rollout/failed_ratio"] == 0.0 and m["rollout/agent_failed_ratio"] == 0.0
        assert m["rollout/sandbox_create_s"] > 0 and m["rollout/sandbox_teardown_s"] > 0
        assert m["rollout/turns_mean"] == 1.0
    finally:
        for pid in with_argument(marker):
            os.kill(pid, signal.SIGKILL)
        subprocess.run(["rm", "-rf", str(shared)], check=False)
