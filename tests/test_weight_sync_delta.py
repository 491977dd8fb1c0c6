"""Delta weight sync through a real run: controller -> trainer actor -> transport -> engine actor.

A tiny job trains for four steps with ``delta = true`` on the ``shm`` transport (a float32 trainer,
a bfloat16 engine: the deltas are taken in the engine's precision). After the run the engines'
weights, read over HTTP (``/get_weights_by_name``), must equal bit for bit those of a fresh engine
that received the run's final weights (its ``final_hf`` export) by a full sync. The run's metrics
must show the deltas: the first sync full, the later ones smaller than the model.

Elsewhere: ``broadcast`` sending the same deltas over a Gloo group into an engine actor,
``plugins/loongsage-plugin-torch/tests/test_transport_delta_broadcast.py``; the codec, checksums
and the healing of a corrupted delta, ``plugins/loongsage-plugin-torch/tests/test_transport_delta.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from loongsage_core.backend_api.serving import engine_headers
from loongsage_core.config import load_job
from loongsage_core.controller.run import make_loop
from loongsage_core.controller.runtime import Run
from loongsage_core.plugins import PluginHost
from loongsage_core.resolve import resolve_job

from .conftest import TINY_JOB, TOKENIZER_DIR

STEPS = 4


def engine_weights(url: str, names: list[str]) -> dict[str, torch.Tensor]:
    """Every named parameter of the engine at ``url``, whole (``truncate_size`` = its size)."""
    out = {}
    for name in names:
        response = httpx.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": 1 << 30},
                              headers=engine_headers(), trust_env=False, timeout=60)
        assert response.status_code == 200, response.text
        out[name] = torch.tensor(response.json(), dtype=torch.float64)
    return out


def run_and_read(job_path: Path, out: Path, overrides: list[str]) -> tuple[list[dict], list[dict[str, torch.Tensor]]]:
    """Run the job; before its actors close, read every engine's weights."""
    run = Run(resolve_job(load_job(job_path, overrides)), out)
    loop = make_loop(run)
    try:
        run.start()
        history = loop.fit()
        run.export_final()
        assert run.actors is not None
        names = [n for n, _ in run_param_names(out)]
        return history, [engine_weights(url, names) for url in run.actors.engine_urls]
    finally:
        run.close()


def run_param_names(out: Path) -> list[tuple[str, torch.Tensor]]:
    """The parameters of the run's final export (the trainer's last weights, float32)."""
    from safetensors.torch import load_file

    state = load_file(str(out / "final_hf" / "model.safetensors"))
    return sorted(state.items())


def full_sync_into_fresh_engine(job_path: Path, out: Path, engine_dtype: str | None) -> dict:
    """A fresh embedded engine (this process) that gets the run's final weights by one full sync
    (no delta) over ``shm``: the bytes of a full sync are the same on every transport, and a
    broadcast group cannot have both of its ends in one process."""
    from loongsage_plugin_torch.engine import create_engine

    from loongsage_hookspecs import EngineContext, WeightTransportContext

    job = load_job(job_path, [f"rollout.engine_args={{dtype = '{engine_dtype}'}}"] if engine_dtype else [])
    host = PluginHost.create(["torch"])
    engine = create_engine(EngineContext(job=job, components=host))
    url = engine.start()
    sender = host.get("weight_transport", "shm").sender(WeightTransportContext(role="sender", job=job))
    try:
        named = run_param_names(out)
        sender.send(iter(named), STEPS, [url])
        return engine_weights(url, [n for n, _ in named])
    finally:
        sender.close()
        engine.shutdown()


@pytest.mark.parametrize("transport, engine_dtype", [("shm", "bfloat16")])
def test_delta_sync_leaves_engines_bit_identical_to_a_full_sync(ray_cluster, tmp_path, transport, engine_dtype):
    job_path = tmp_path / "job.toml"
    job_path.write_text(TINY_JOB.format(tokenizer=TOKENIZER_DIR))
    args = "{ delta = true, full_every = 100" + (", backend = 'gloo' }" if transport == "broadcast" else " }")
    overrides = [f"train.total_steps={STEPS}", "placement.colocate=false", f"rollout.weight_transport={transport}",
                 f"rollout.weight_transport_args={args}", "run.save_hf_at_end=true", "train.lr=1e-5",
                 "algorithm.entropy_coef=0.01"]  # a gradient on every step, whatever the rewards
    if engine_dtype:
        overrides.append(f"rollout.engine_args={{dtype = '{engine_dtype}'}}")
    out = tmp_path / "run"
    history, engines = run_and_read(job_path, out, overrides)

    expected = full_sync_into_fresh_engine(job_path, out, engine_dtype)
    for got in engines:
        assert sorted(got) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), name

    # the first sync (after step 1) is full, each later one a delta smaller than the model; the
    # bytes a full sync would move are the model's in the engine's precision
    itemsize = torch.finfo(getattr(torch, engine_dtype or "float32")).bits // 8
    full_bytes = sum(t.numel() * itemsize for _, t in run_param_names(out))
    assert len(history) == STEPS
    assert history[0]["perf/weight_sync_full"] == 1.0 and history[0]["perf/weight_sync_delta_ratio"] == 1.0
    for m in history[1:]:
        assert m["perf/weight_sync_full"] == 0.0 and m["perf/weight_sync_fallbacks"] == 0.0
        assert 0.0 < m["perf/weight_sync_delta_ratio"] < 1.0
    for m in history:
        assert m["perf/weight_sync_bytes"] == pytest.approx(m["perf/weight_sync_delta_ratio"] * full_bytes)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["perf/weight_sync_delta_ratio"] for row in logged if "perf/weight_sync_delta_ratio" in row] \
        == [m["perf/weight_sync_delta_ratio"] for m in history]
