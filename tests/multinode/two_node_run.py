"""A run across two Ray nodes on this machine, started by ``test_two_nodes.py`` in a process of its own.

Usage: ``python two_node_run.py JOB_TOML RUN_DIR`` prints one JSON object (the last line of stdout).

Two nodes of one Ray cluster (``ray.cluster_utils.Cluster``: a head and a second node, each a set
of Ray processes of its own, one IP) carry distinct custom resources, ``train_node`` and
``engine_node``. The job pins the trainer to the first and the engine to the second with
``placement.trainer_resources`` / ``placement.engine_resources`` and joins the cluster the way a
user does, through ``RAY_ADDRESS``, with ``loongsage run``. Afterwards an engine actor is started
on the engine node once more, to probe what its listening address lets through.

Its own process because a test session's driver already belongs to a one-node cluster, and
because Ray must not be kept on loopback here (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

NODE_MB = 96  # object store per node: the tiny model's rows and weights need little


def probe_engine(job_path: str, secret: str) -> dict[str, Any]:
    """Start an engine-only actor on the engine node with ``secret``; what its endpoints answer
    with no token, a wrong one and the right one."""
    import httpx
    import ray

    from loongsage_core.config import load_job
    from loongsage_core.controller.actors import ModelActor
    from loongsage_core.resolve import resolve_job

    job = resolve_job(load_job(job_path, [])).job
    actor = ray.remote(ModelActor).options(num_cpus=1, resources={"engine_node": 1}).remote(
        job, None, 1, 0, False, secret)
    try:
        ray.get(actor.start.remote("", 0))  # an engine-only actor joins no trainer group
        url = ray.get(actor.ready.remote())["engine_url"]
        wrong = {"Authorization": "Bearer not-the-run-secret"}
        right = {"Authorization": f"Bearer {secret}"}
        with httpx.Client(trust_env=False, timeout=120) as http:
            refused = {
                "pause": http.post(url + "/pause_generation", json={"mode": "abort"}).status_code,
                "abort": http.post(url + "/abort_request", json={"abort_all": True}).status_code,
                "update_weights": http.post(url + "/update_weights_from_tensor",
                                            json={"serialized_named_tensors": [], "load_format": "direct"}
                                            ).status_code,
                "join_group": http.post(url + "/init_weights_update_group", headers=wrong,
                                        json={"master_address": "192.0.2.99", "master_port": 1, "rank_offset": 1,
                                              "world_size": 2, "group_name": "x", "backend": "gloo"}).status_code,
                "server_info": http.get(url + "/get_server_info", headers=wrong).status_code,
                "generate": http.post(url + "/generate", json={"input_ids": [5, 6, 7]}).status_code,
            }
            generate = http.post(url + "/generate", headers=right,
                                 json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
            health = http.get(url + "/health").status_code
        return {"url": url, "refused": refused, "generate_status": generate.status_code,
                "generated": len(generate.json().get("output_ids", [])) if generate.status_code == 200 else 0,
                "health": health}
    finally:
        try:
            ray.get(actor.shutdown.remote())
        finally:
            ray.kill(actor)


def main(job_path: str, run_dir: str) -> int:
    import ray
    from ray.cluster_utils import Cluster

    from loongsage_core import cli
    from loongsage_core.security import read_secret_file

    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"train_node": 1}, "object_store_memory": NODE_MB << 20,
        "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, resources={"engine_node": 1}, object_store_memory=NODE_MB << 20)
        os.environ["RAY_ADDRESS"] = cluster.address  # how a user attaches a run to an existing cluster
        t_cluster = time.perf_counter()
        code = cli.main(["run", job_path, "--output-dir", run_dir])
        t_run = time.perf_counter()
        nodes = [{"ip": n["NodeManagerAddress"], "id": n["NodeID"],
                  "resources": sorted(k for k in n["Resources"] if k.endswith("_node"))}
                 for n in ray.nodes() if n["Alive"]]
        # where the run's model actors lived (Ray's actor table keeps finished actors; the state
        # API would need the dashboard)
        from ray._private.state import actors as actor_table

        model_actors = sorted(a["Address"]["NodeID"] for a in actor_table().values()
                              if a["ActorClassName"] == "ModelActor")
        probe = probe_engine(job_path, read_secret_file(run_dir)) if code == 0 else {}
        metrics = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
                   if line.strip()] if code == 0 else []
        host = urlsplit(probe["url"]).hostname if probe else None
        print(json.dumps({"exit_code": code, "nodes": nodes, "model_actor_nodes": model_actors,
                          "metrics": metrics, "probe": probe,
                          "engine_host": host, "seconds": {"cluster": t_cluster - t0, "run": t_run - t_cluster,
                                                           "total": time.perf_counter() - t0}}))
        return 0
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
