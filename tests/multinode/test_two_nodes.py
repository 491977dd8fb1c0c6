"""A run on a two-node Ray cluster (one machine): trainer on one node, engine on the other.

``two_node_run.py`` (its own process) starts the cluster, runs one real training step of the tiny
job through ``loongsage run`` attached with ``RAY_ADDRESS``, and probes an engine on the engine
node. Asserted here: each role ran on the node its ``placement.*_resources`` asked for (the
``auto`` weight transport, which compares Ray node ids, chose ``broadcast`` for the engine: a
same-node engine would have taken shared memory), the step trained and moved the weights, and the
engine, listening on its node's address, refuses control requests without the run secret while
serving generation with it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("two_node_run.py")

PLACEMENT = """
[placement]
colocate = false
trainer_cpus = 1
engine_cpus = 1
trainer_resources = { train_node = 1 }
engine_resources = { engine_node = 1 }
"""


@pytest.mark.slow
def test_trainer_and_engine_on_two_nodes_train_and_broadcast_weights(tmp_path, tiny_job):
    job = tiny_job.write(tmp_path)
    text = job.read_text().replace("total_steps = 3", "total_steps = 1").replace("checkpoint_every = 1",
                                                                                 "checkpoint_every = 0")
    job.write_text(text + PLACEMENT)
    # a Ray temp dir of its own: the cluster's address file (Ray's "latest cluster", which a plain
    # ray.init() elsewhere on this machine would join) and its sockets stay out of /tmp/ray; short,
    # because Unix socket paths are limited to ~100 bytes
    ray_tmp = tempfile.mkdtemp(prefix="lsray-", dir="/tmp")
    # workers at the test's own priority, as on the local cluster (placement.keep_workers_at_driver_priority)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "TOKENIZERS_PARALLELISM": "false",
           "RAY_TMPDIR": ray_tmp, "RAY_worker_niceness": "0"}
    env.pop("RAY_ADDRESS", None)
    try:
        proc = subprocess.run([sys.executable, str(SCRIPT), str(job), str(tmp_path / "run")], env=env,
                              capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["exit_code"] == 0, proc.stderr[-4000:]

    # two Ray nodes, each with one of the roles' resources
    assert sorted(n["resources"] for n in out["nodes"]) == [["engine_node"], ["train_node"]]
    assert len({n["id"] for n in out["nodes"]}) == 2
    # the run's two model actors (trainer rank 0, engine 0) lived on the two nodes, one each
    assert sorted(out["model_actor_nodes"]) == sorted(n["id"] for n in out["nodes"])

    # one real step: trained, weights moved by broadcast (the trainer's and engine's nodes differ)
    (step,) = out["metrics"]
    assert step["perf/generated_tokens"] > 0 and step["perf/weight_version"] == 1.0
    assert "train/num_mini_batches" in step and step["train/num_mini_batches"] >= 1
    assert step["perf/weight_sync_perf/weight_targets_broadcast"] == 1.0
    assert not any(k.startswith("perf/weight_sync_perf/weight_targets_") and not k.endswith("_broadcast")
                   for k in step)
    assert step["perf/weight_sync_perf/weight_update_bytes"] > 0

    # the engine listens on (and advertises) its node's address, the one Ray reports for the node
    engine_ip = next(n["ip"] for n in out["nodes"] if n["resources"] == ["engine_node"])
    assert out["engine_host"] == engine_ip
    probe = out["probe"]
    assert probe["health"] == 200
    assert probe["refused"] == {"pause": 401, "abort": 401, "update_weights": 401, "join_group": 401,
                                "server_info": 401, "generate": 401}
    assert probe["generate_status"] == 200 and probe["generated"] > 0
