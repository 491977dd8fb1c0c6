"""Trainer -> weight transport -> embedded engine: after an update the engine scores tokens like the trainer.

Uses only the public surfaces: the train backend factory, the transports' factories, the engine
factory with its SGLang-style HTTP API (``/update_weights_from_tensor``, ``/generate``,
``/get_weight_version``) and its in-process ``load_weights(weights, version)``.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from loongsage_plugin_torch.engine import create_engine
from loongsage_plugin_torch.modeling import TINY_QWEN3
from loongsage_plugin_torch.trainer import create_train_worker

from loongsage_core.algorithms import compute_norm
from loongsage_core.config import AlgorithmConfig, JobConfig, ModelConfig, TrainConfig
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import (
    Batch,
    EngineContext,
    TrainWorkerContext,
    WeightTransportContext,
)

TOKENIZER = str(Path(__file__).resolve().parents[3] / "tests" / "data" / "tokenizer")


def Components() -> PluginHost:  # noqa: N802 - reads like the registry a backend receives
    """The real component registry of a run with the rl and torch plugins (``reinforce``,
    ``token_mean``, the ``shm`` / ``inprocess`` transports)."""
    return PluginHost.create(enable=["rl", "torch"])


def generate(url: str, prompt: list[int]) -> dict:
    body = {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": 3}}
    response = httpx.post(url + "/generate", json=body, trust_env=False, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("transport", ["shm", "inprocess"])
def test_engine_matches_trainer_after_weight_update(transport):
    # the engine starts from other weights (seed 1) than the trainer (seed 0)
    engine_job = JobConfig(model=ModelConfig(config=dict(TINY_QWEN3), tokenizer=TOKENIZER, seed=1))
    trainer_job = JobConfig(model=ModelConfig(config=dict(TINY_QWEN3), tokenizer=TOKENIZER),
                            train=TrainConfig(lr=1e-2, micro_batch_size=4),
                            algorithm=AlgorithmConfig(policy_loss="reinforce", loss_agg="token_mean"))
    worker = create_train_worker(TrainWorkerContext(job=trainer_job, components=Components()))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 512, (4, 16), generator=g)
    mask = torch.zeros_like(ids)
    mask[:, 8:] = 1
    batch = Batch(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask,
                           "advantages": torch.randn(4, 1, generator=g) * mask, "old_logprobs": torch.zeros(4, 16)})
    worker.train_mini_batch(batch, compute_norm(batch))

    engine = create_engine(EngineContext(job=engine_job, components=Components()))
    url = engine.start()
    try:
        prompt = ids[0, :8].tolist()
        sender = Components().get("weight_transport", transport).sender(WeightTransportContext(role="sender"))
        target = url if transport == "shm" else engine
        sender.send(worker.named_weights(), 7, [target])
        sender.close()
        assert httpx.get(url + "/get_weight_version", trust_env=False).json()["weight_version"] == "7"

        out = generate(url, prompt)
        meta = out["meta_info"]
        engine_logprobs = torch.tensor([triple[0] for triple in meta["output_token_logprobs"]])
        assert meta["output_token_weight_versions"] == [7] * len(out["output_ids"])
        tokens = torch.tensor([prompt + out["output_ids"]])
        trainer_logprobs = worker.forward(Batch(tensors={"input_ids": tokens,
                                                         "attention_mask": torch.ones_like(tokens)}))["logprobs"]
        torch.testing.assert_close(engine_logprobs, trainer_logprobs[0, len(prompt):], rtol=0, atol=1e-4)
    finally:
        engine.shutdown()
