"""Data parallelism of the torch train backend: 2 real processes over Gloo equal 1 process.

The test launches this file as a script once per rank (``python test_trainer_dp.py RANK WORLD OUT
full|lora``; ``lora`` trains a LoRA adapter, whose random initialisation rank 0 broadcasts);
rank 0 listens for the rendezvous on a port the OS assigns and writes it to ``OUT/port`` for the
other rank (no port is picked in one process and bound in another); each rank trains on its
half of the rows with the mini-batch's global norm and writes its gradients, metrics and updated
weights for the test to compare with a single-process run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from loongsage_plugin_torch.modeling import TINY_QWEN3
from loongsage_plugin_torch.trainer import create_train_worker

from loongsage_core.algorithms import compute_norm
from loongsage_core.config import AlgorithmConfig, JobConfig, LoraConfig, ModelConfig, TrainConfig
from loongsage_core.plugins import PluginHost
from loongsage_core.rendezvous import host_rendezvous
from loongsage_hookspecs import (
    AggregationSpec,
    Batch,
    PolicyLossOutput,
    PolicyLossSpec,
    TrainWorkerContext,
)

ROWS = 8


def clipped_pg(x, eps=0.2):
    ratio = torch.exp(x.logprobs - x.old_logprobs)
    a, b = -x.advantages * ratio, -x.advantages * torch.clamp(ratio, 1 - eps, 1 + eps)
    return PolicyLossOutput(loss=torch.maximum(a, b), metrics={"clip_ratio": (b > a).float()})


def seq_mean_token_mean(loss, mask, norm):
    return ((loss * mask).sum(1) / mask.sum(1).clamp_min(1)).sum() / norm.num_sequences


def Components() -> PluginHost:  # noqa: N802 - reads like the registry a backend receives
    """The real registry with this file's reference loss and aggregation."""
    host = PluginHost.create(enable=["torch"])
    host.register_specs(PolicyLossSpec(name="clipped_pg", fn=clipped_pg),
                        AggregationSpec(name="seq_mean_token_mean", fn=seq_mean_token_mean))
    return host


def make_job(variant: str = "full") -> JobConfig:
    lora = LoraConfig(rank=4, alpha=8.0) if variant == "lora" else None
    return JobConfig(model=ModelConfig(config=dict(TINY_QWEN3)),
                     train=TrainConfig(lr=1e-3, micro_batch_size=2, grad_clip=0.1 if lora else 0.5, lora=lora),
                     algorithm=AlgorithmConfig(policy_loss="clipped_pg", loss_agg="seq_mean_token_mean",
                                               entropy_coef=0.01))


def make_batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    width = 20
    lengths = torch.randint(10, width + 1, (ROWS,), generator=g)
    t = torch.arange(width)
    attention = (t[None, :] < lengths[:, None]).long()
    loss_mask = ((t[None, :] >= 4) & (t[None, :] < lengths[:, None])).long()
    old = (-6.0 + 0.5 * torch.randn(ROWS, width, generator=g)) * loss_mask
    return Batch(tensors={"input_ids": torch.randint(1, 512, (ROWS, width), generator=g) * attention,
                          "attention_mask": attention, "loss_mask": loss_mask, "old_logprobs": old,
                          "advantages": (torch.randn(ROWS, 1, generator=g) * loss_mask).contiguous()})


def train_once(rank: int, world: int, port: int, variant: str = "full") -> dict:
    """One optimizer step on this rank's rows; returns what the comparison needs."""
    job = make_job(variant)
    worker = create_train_worker(TrainWorkerContext(job=job, components=Components(), rank=rank, world_size=world,
                                                    master_port=port))
    batch = make_batch()
    global_norm = compute_norm(batch)
    shard = batch.select(range(rank * ROWS // world, (rank + 1) * ROWS // world))
    shard_norm = compute_norm(shard, world=True)
    metrics = worker.accumulate_gradients(shard, global_norm)
    grads = {n: p.grad.clone() for n, p in worker.model.named_parameters() if p.requires_grad}
    metrics.update(worker.optimizer_step())
    weights = {n: t.clone() for n, t in worker.named_weights()}
    worker.close()
    return {"grads": grads, "metrics": metrics, "weights": weights, "norm_ok": shard_norm == global_norm}


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["full", "lora"])
def test_two_ranks_with_half_the_rows_equal_one_rank_with_all(tmp_path, variant):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, str(r), "2", str(tmp_path), variant], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    single = train_once(0, 1, 0, variant)
    assert single["grads"] and all((".lora_" in n) == (variant == "lora") for n in single["grads"])
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out.decode()[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]

    assert all(r["norm_ok"] for r in ranks)
    for name, g in single["grads"].items():
        torch.testing.assert_close(ranks[0]["grads"][name], g, rtol=1e-4, atol=1e-7, msg=name)
        assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name]), name
    for name, w in single["weights"].items():
        torch.testing.assert_close(ranks[0]["weights"][name], w, rtol=0, atol=1e-6, msg=name)
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name
    assert single["metrics"].keys() == ranks[0]["metrics"].keys()
    for key, value in single["metrics"].items():
        assert abs(ranks[0]["metrics"][key] - value) <= 1e-5 * max(1.0, abs(value)), key
        assert ranks[0]["metrics"][key] == ranks[1]["metrics"][key], key
    assert single["metrics"]["train/grad_norm"] > make_job(variant).train.grad_clip  # clipping was active


if __name__ == "__main__":
    torch.set_num_threads(1)
    rank_, world_, out_, variant_ = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    port_file = out_ / "port"
    if rank_ == 0:
        rendezvous = host_rendezvous()  # listening before the other rank learns the port
        (out_ / "port.tmp").write_text(str(rendezvous.port))
        (out_ / "port.tmp").rename(port_file)
        port_ = rendezvous.port
    else:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"rank {rank_}: rank 0 published no rendezvous port in {port_file}")
            time.sleep(0.05)
        port_ = int(port_file.read_text())
    torch.save(train_once(rank_, world_, port_, variant_), out_ / f"rank{rank_}.pt")
