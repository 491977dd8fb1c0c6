"""The control plane of a real run (`loongsage serve`: Ray actors, engines, router) is closed, and
the local Ray cluster listens on loopback only."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from openai import AuthenticationError, OpenAI

from loongsage_core.config import load_job
from loongsage_core.controller.serve import start_serving
from loongsage_core.engine_client import EngineClient
from loongsage_core.resolve import resolve_job
from loongsage_core.security import read_secret_file

REPO = Path(__file__).resolve().parent.parent

JOB = f"""
[plugins]
enable = ["torch", "rl", "rewards", "loggers", "agents"]

[model]
path = "{REPO / 'configs' / 'quickstart' / 'model'}"

[rollout]
max_new_tokens = 8

[placement]
colocate = false

[[data]]
name = "arith"
generator = "arithmetic"
reward = ["numeric_match"]
"""

RAY_PROBE = textwrap.dedent("""
    import json, os, re, subprocess
    import ray
    from loongsage_core.config import structure_job
    from loongsage_core.controller.placement import init_ray

    init_ray(structure_job({"run": {"ray_num_cpus": 1, "ray_object_store_mb": 80}}))

    @ray.remote
    class Probe:
        def pid(self):
            return os.getpid()

        def niceness(self):
            return os.nice(0)

    probe = Probe.remote()
    ray.get(probe.pid.remote())
    print("NICENESS " + json.dumps({"driver": os.nice(0), "worker": ray.get(probe.niceness.remote())}))
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    mine, todo = set(), [os.getpid()]
    while todo:
        pid = todo.pop()
        mine.add(pid)
        todo += children.get(pid, [])
    listening = []
    for line in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines():
        if {int(p) for p in re.findall(r"pid=(\\d+)", line)} & mine:
            listening.append([line.split()[3], re.findall(r'\\("([^"]+)"', line)])
    ray.shutdown()
    print("LISTENING " + json.dumps(listening))
""")




@pytest.fixture(scope="module")
def ray_probe(slow_fixture, tmp_path_factory) -> dict:
    """What a process that started the run's local Ray cluster (``init_ray``) saw of it."""
    proc = subprocess.run([sys.executable, "-c", RAY_PROBE], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path_factory.mktemp("ray_probe"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {key: json.loads(proc.stdout.split(f"{key} ", 1)[1].splitlines()[0])
            for key in ("LISTENING", "NICENESS")}


def test_local_ray_cluster_listens_on_loopback_only(ray_probe):
    listening = ray_probe["LISTENING"]
    names = {name for _, procs in listening for name in procs}
    assert {"gcs_server", "raylet"} <= names, listening  # the probe saw Ray's servers
    loopback = re.compile(r"^(127\.0\.0\.1|\[::ffff:127\.0\.0\.1\]|\[::1\]):\d+$")
    exposed = [(addr, procs) for addr, procs in listening if not loopback.match(addr)]
    assert exposed == [], f"Ray listens beyond loopback: {exposed}"


def test_model_actors_run_at_the_drivers_priority(ray_probe):
    # Ray's default starts workers at niceness 15: the trainer and engines would then wait behind
    # the driver's router and any busy process of the machine
    assert ray_probe["NICENESS"]["worker"] == ray_probe["NICENESS"]["driver"]


@pytest.fixture(scope="module")
def serving(ray_cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "job.toml").write_text(JOB)
    s = start_serving(resolve_job(load_job(tmp / "job.toml")), output_dir=tmp / "run")
    yield s
    s.close()


def test_serve_writes_a_private_secret_that_engines_and_admin_require(serving, engine_call):
    assert serving.secret_path.stat().st_mode & 0o777 == 0o600
    secret = read_secret_file(serving.secret_path)
    auth = {"Authorization": f"Bearer {secret}"}
    base = serving.router.base_url
    assert httpx.get(f"{base}/admin/trajectories/{serving.trajectory_id}").status_code == 401
    assert httpx.get(f"{base}/admin/trajectories/{serving.trajectory_id}", headers=auth).status_code == 200
    for url in serving.actors.engine_urls:
        assert url.startswith("http://127.0.0.1:")
        assert httpx.post(url + "/pause_generation", json={"mode": "abort"}).status_code == 401
        assert httpx.post(url + "/release_memory_occupation", json={}).status_code == 401
        assert httpx.get(url + "/health").status_code == 200
        assert engine_call(url, lambda c: c.weight_version(), api_key=secret) == 0


def test_weight_overwrite_of_a_served_engine_fails_and_greedy_answers_stay(serving, engine_call):
    import base64
    import io

    import torch

    secret = read_secret_file(serving.secret_path)
    [url] = serving.actors.engine_urls
    client = EngineClient(url, api_key=secret)
    prompt = [[1, 2, 3, 4, 5]]
    before = client.generate_sync(prompt, {"temperature": 0.0, "max_new_tokens": 8})[0].output_ids
    buf = io.BytesIO()
    torch.save([("model.embed_tokens.weight", torch.zeros(2, 2))], buf)
    resp = httpx.post(url + "/update_weights_from_tensor", timeout=60, json={
        "serialized_named_tensors": base64.b64encode(buf.getvalue()).decode(), "load_format": "direct"})
    assert resp.status_code == 401
    assert client.generate_sync(prompt, {"temperature": 0.0, "max_new_tokens": 8})[0].output_ids == before
    assert engine_call(url, lambda c: c.weight_version(), api_key=secret) == 0


def test_served_trajectory_opens_with_its_key_only(serving):
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    reply = OpenAI(base_url=serving.trajectory_url, api_key=serving.trajectory_key, max_retries=0) \
        .chat.completions.create(model="policy", max_tokens=4, messages=messages)
    assert reply.usage.completion_tokens >= 1
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=serving.trajectory_url, api_key="guess", max_retries=0).chat.completions.create(
            model="policy", max_tokens=4, messages=messages)


@pytest.mark.slow
def test_loongsage_serve_prints_the_agent_url_its_key_and_where_the_secret_is(tmp_path):
    import os
    import signal

    (tmp_path / "job.toml").write_text(JOB)
    run_dir = tmp_path / "served"
    log = (tmp_path / "serve.log").open("w")
    # started with SIGINT ignored, as a background job of a script is: serve still stops on it
    proc = subprocess.Popen([sys.executable, "-m", "loongsage_core", "serve", str(tmp_path / "job.toml"),
                             "run.ray_num_cpus=2", "run.ray_object_store_mb=80", "--output-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    lines: list[str] = []
    try:
        # serve prints its six lines together once the engines are up; the suite's timeout guards a hang
        while not any(line.startswith("what it recorded") for line in lines):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
        printed = {line.split(":", 1)[0]: line.split(": ", 1)[1] for line in lines if ": " in line}
        assert "what it recorded" in printed, f"serve printed {lines}; stderr tail: " \
            f"{(tmp_path / 'serve.log').read_text()[-3000:]}"
        secret_file = run_dir / "run_secret"
        assert printed["run secret file (mode 0600; /admin and the engines want it as a bearer token)"] \
            == str(secret_file)
        assert secret_file.stat().st_mode & 0o777 == 0o600
        url = printed["example trajectory endpoint (OPENAI_BASE_URL)"]
        key = printed["its key (OPENAI_API_KEY; opens this endpoint only)"]
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(url + "/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert httpx.get(url + "/models").status_code == 401
        assert read_secret_file(secret_file) not in "\n".join(lines)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0  # a clean stop: engines and router shut down, no kill needed
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()
