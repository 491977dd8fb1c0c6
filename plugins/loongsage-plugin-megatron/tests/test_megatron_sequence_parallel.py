"""Sequence parallelism (``[train] backend_args.sequence_parallel``) in the megatron train backend (CPU).

TP = 2 with sequence parallelism against TP = 1 on the dense tiny Qwen3 of ``conftest.py`` (the
model of ``test_megatron_backend``'s TP tests) and on the tiny Qwen3-MoE of
``megatron_test_support`` (TP = 2 + SP, EP = 1: Megatron-Core trains MoE layers under tensor
parallelism only with sequence parallelism): per-token log-probs and one training step's loss and
gradient norm. The batches are 11 tokens wide, so every micro-batch is padded to a multiple of
tp = 2 before Megatron-Core splits its sequence over the two ranks. Both ranks run in two spawned
processes; rank 0 alone then builds the TP = 1 references.
"""

from __future__ import annotations

import pytest
import torch

try:
    import megatron.core  # noqa: F401
except ImportError as exc:  # fail, never skip: the backend's tests need the real library
    raise ImportError("megatron-core is not installed: pip install -r requirements-megatron.txt") from exc

import megatron_test_support as support
from loongsage_plugin_megatron import plugin
from loongsage_plugin_torch.trainer import create_train_worker as create_torch_worker

from loongsage_core.algorithms import compute_norm
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import Batch, TrainWorkerContext

WIDTH = 11  # not a multiple of tp = 2: sequence parallelism pads every micro-batch


def odd_batch(seed: int, rows: int = 4) -> Batch:
    return support.make_batch(rows=rows, width=WIDTH, seed=seed)


def _two_rank_job(rank: int, out: str, dense_dir: str, moe_dir: str, batches: dict) -> dict:
    """TP = 2 + SP on both ranks (dense, then MoE): forward and one training step; then the
    TP = 1 references on rank 0 alone. Returns the rank's results."""
    ports, _listening = support.rendezvous_ports(rank, out, 2)
    host = PluginHost.create([])
    result: dict = {}

    def worker(port: int, path: str, world: int = 2, **backend_args):
        return plugin.create_train_worker(TrainWorkerContext(
            job=support.make_job(path, **backend_args), components=host, rank=rank, world_size=world,
            master_port=port))

    def run(w, name: str, batch: Batch) -> None:
        result[f"{name}_forward"] = w.forward(odd_batch(seed=0))
        result[f"{name}_forward_3"] = w.forward(odd_batch(seed=3, rows=3))
        result[f"{name}_metrics"] = w.train_mini_batch(batch, compute_norm(batch))
        result[f"{name}_forward_after"] = w.forward(odd_batch(seed=0))
        w.close()

    w = worker(ports[0], dense_dir, tp=2, sequence_parallel=True)
    result["dense_sp"] = w.sequence_parallel
    run(w, "dense_tp2", batches["dense"])
    w = worker(ports[1], moe_dir, tp=2)  # sequence parallelism is the default for MoE under tp > 1
    result["moe_sp"] = w.sequence_parallel
    run(w, "moe_tp2", batches["moe"])
    if rank == 0:
        run(worker(0, dense_dir, world=1), "dense_tp1", batches["dense"])
        run(worker(0, moe_dir, world=1), "moe_tp1", batches["moe"])
    return result


@pytest.fixture(scope="module")
def two_ranks(slow_fixture, hf_dir, tmp_path_factory):
    host = PluginHost.create([])
    moe_dir = str(tmp_path_factory.mktemp("tiny_qwen3_moe_sp"))
    moe_hf = support.save_tiny_moe(moe_dir)
    ref = create_torch_worker(TrainWorkerContext(job=support.make_job(hf_dir), components=host))
    dense = odd_batch(seed=6)
    moe = odd_batch(seed=6)
    batches = {"dense": support.with_old_logprobs(dense, ref.forward(dense)["logprobs"], seed=6),
               "moe": support.with_hf_old_logprobs(moe_hf, moe, seed=6)}
    out = tmp_path_factory.mktemp("sequence_parallel_ranks")
    return support.run_ranks(_two_rank_job, 2, out, hf_dir, moe_dir, batches)


def _assert_tp2_sp_equals_tp1(ranks: list[dict], name: str) -> None:
    rank0, rank1 = ranks
    for rank in (rank0, rank1):
        for key in ("forward", "forward_3", "forward_after"):
            for out in ("logprobs", "entropy"):
                got, want = rank[f"{name}_tp2_{key}"][out], rank0[f"{name}_tp1_{key}"][out]
                assert got.shape == want.shape
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"{name} {key} {out}")
        got, want = rank[f"{name}_tp2_metrics"], rank0[f"{name}_tp1_metrics"]
        assert want["train/grad_norm"] > 0
        assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-4)
        for key in ("train/loss", "train/pg_loss", "train/entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key


def test_dense_tp2_with_sequence_parallel_equals_tp1(two_ranks):
    assert two_ranks[0]["dense_sp"] and two_ranks[1]["dense_sp"]
    _assert_tp2_sp_equals_tp1(two_ranks, "dense")


def test_moe_tp2_with_sequence_parallel_equals_tp1(two_ranks):
    assert two_ranks[0]["moe_sp"] and two_ranks[1]["moe_sp"]  # the default for MoE under tp > 1
    _assert_tp2_sp_equals_tp1(two_ranks, "moe")


def test_sequence_parallel_options_are_checked(hf_dir, tmp_path):
    from loongsage_plugin_megatron.layout import BackendOptions, sequence_parallel

    host = PluginHost.create([])
    with pytest.raises(ValueError, match=r"backend_args.sequence_parallel = true needs tp > 1"):
        plugin.create_train_worker(TrainWorkerContext(job=support.make_job(hf_dir, sequence_parallel=True),
                                                      components=host))
    with pytest.raises(ValueError, match="sequence_parallel"):
        plugin.create_train_worker(TrainWorkerContext(job=support.make_job(hf_dir, sequence_parallel="yes"),
                                                      components=host))
    moe_dir = str(tmp_path / "moe")
    support.save_tiny_moe(moe_dir)
    with pytest.raises(ValueError, match=r"backend_args.tp = 2 with sequence_parallel = false: Mixture-of-Experts "
                                         r"models need sequence parallelism"):
        plugin.create_train_worker(TrainWorkerContext(job=support.make_job(moe_dir, tp=2, sequence_parallel=False),
                                                      components=host, world_size=2))
    # defaults: on for MoE under tp > 1, off for a dense model and under tp = 1
    assert sequence_parallel(BackendOptions(tp=2), 2, num_experts=4)
    assert not sequence_parallel(BackendOptions(tp=2), 2, num_experts=None)
    assert not sequence_parallel(BackendOptions(), 1, num_experts=4)
    assert sequence_parallel(BackendOptions(tp=2, sequence_parallel=True), 2, num_experts=None)
