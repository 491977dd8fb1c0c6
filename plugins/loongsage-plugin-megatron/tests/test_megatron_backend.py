"""The megatron train backend against the torch backend on the same tiny Qwen3 weights (CPU).

The multi-rank checks (TP=2 x PP=2, TP=2, DP=2, checkpoint resume, PP=2) share one spawned set of
four processes (``multi_rank`` fixture) that runs them as successive phases, each with its own
process group: all four ranks in the first phase, ranks 0 and 1 in the two-rank phases after it.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

try:
    import megatron.core  # noqa: F401
except ImportError as exc:  # fail, never skip: the backend's tests need the real library
    raise ImportError("megatron-core is not installed: pip install -r requirements-megatron.txt") from exc

from loongsage_plugin_megatron import plugin
from loongsage_plugin_torch.modeling import TINY_QWEN3
from loongsage_plugin_torch.trainer import create_train_worker as create_torch_worker

from loongsage_core.algorithms import compute_norm
from loongsage_core.config import AlgorithmConfig, JobConfig, ModelConfig, TrainConfig
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import Batch, TrainWorker, TrainWorkerContext

TOKENIZER = str(Path(__file__).resolve().parents[3] / "tests" / "data" / "tokenizer")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = dict(TINY_QWEN3)
    model_type = conf.pop("model_type")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **conf), dtype=torch.float32)
    out = tmp_path_factory.mktemp("tiny_qwen3")
    model.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def host() -> PluginHost:
    return PluginHost.create([])


def make_job(path: str, **backend_args) -> JobConfig:
    # Warmup then cosine decay: the first step trains at lr / 2, so the schedule shows in every step.
    return JobConfig(model=ModelConfig(path=path, tokenizer=TOKENIZER),
                     train=TrainConfig(lr=1e-3, micro_batch_size=2, grad_clip=1.0, lr_schedule="cosine",
                                       lr_warmup_steps=2, total_steps=6, weight_decay=0.01,
                                       backend_args=backend_args),
                     algorithm=AlgorithmConfig(entropy_coef=0.01))


def make_batch(rows: int = 4, width: int = 12, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=g)
    lengths[0] = width
    t = torch.arange(width)
    attention = (t[None, :] < lengths[:, None]).long()
    loss_mask = ((t[None, :] >= 3) & (t[None, :] < lengths[:, None])).long()
    ids = torch.randint(1, 512, (rows, width), generator=g) * attention
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:rows, None] * loss_mask
    return Batch(tensors={"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask,
                          "advantages": adv.float()}, meta={"sample_id": [f"s{i}" for i in range(rows)]})


@pytest.fixture(scope="module")
def workers(hf_dir, host):
    backends = {s.name: s for s in plugin.loongsage_train_backends()}
    meg = backends["megatron"].factory(TrainWorkerContext(job=make_job(hf_dir), components=host))
    ref = create_torch_worker(TrainWorkerContext(job=make_job(hf_dir), components=host))
    yield meg, ref
    meg.close()


def test_logprobs_equal_torch_backend(workers):
    meg, ref = workers
    assert isinstance(meg, TrainWorker)
    batch = make_batch()
    a, b = meg.forward(batch), ref.forward(batch)
    assert torch.all(a["logprobs"][:, 0] == 0)
    torch.testing.assert_close(a["logprobs"], b["logprobs"], rtol=0, atol=1e-5)
    torch.testing.assert_close(a["entropy"], b["entropy"], rtol=0, atol=1e-5)


def test_hf_export_equals_torch_state_dict(workers):
    meg, ref = workers
    exported = dict(meg.named_weights())
    expected = dict(ref.named_weights())
    assert set(exported) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)


def make_train_batch(ref, seed: int) -> Batch:
    """A GRPO batch whose ``old_logprobs`` are ``ref``'s log-probs plus a little noise (ratios near 1)."""
    batch = make_batch(seed=seed)
    old = ref.forward(batch)["logprobs"]
    noise = 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(seed + 2))
    batch.tensors["old_logprobs"] = (old + noise) * batch["loss_mask"]
    return batch


def test_grpo_step_matches_torch_backend(workers):
    meg, ref = workers
    batch = make_train_batch(ref, seed=1)
    norm = compute_norm(batch)
    m_meg = meg.train_mini_batch(batch, norm)
    m_ref = ref.train_mini_batch(batch, norm)
    assert m_meg["train/grad_norm"] > 0
    assert abs(m_meg["train/grad_norm"] - m_ref["train/grad_norm"]) < 1e-4 * m_ref["train/grad_norm"]
    for key in m_ref:
        if key.startswith("train/") and key in m_meg:
            assert m_meg[key] == pytest.approx(m_ref[key], rel=1e-4, abs=1e-6), key
    # Adam normalises each element, so near-zero gradients amplify rounding: check the step moved
    # both models alike on average rather than element by element.
    after, moved = dict(meg.named_weights()), dict(ref.named_weights())
    diff = torch.cat([(after[n] - t).abs().flatten() for n, t in moved.items()])
    assert diff.mean() < 1e-5


def test_optimizer_is_megatrons_and_clips_its_grad_buffers(workers):
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer

    meg, ref = workers
    assert isinstance(meg.optimizer, MegatronOptimizer) and isinstance(meg.model, DistributedDataParallel)
    batch = make_train_batch(ref, seed=4)
    metrics = meg.train_mini_batch(batch, compute_norm(batch))
    clip = meg.job.train.grad_clip
    assert metrics["train/grad_norm"] > clip and metrics["train/skipped_step"] == 0.0  # clipping engaged
    # Megatron's step() clipped the reduced gradients where they live, in the DDP grad buffer.
    clipped = torch.linalg.vector_norm(torch.cat([b.grad_data for b in meg.model.buffers]))
    assert float(clipped) == pytest.approx(clip, rel=1e-5)


def test_not_finite_gradients_skip_the_step(workers):
    meg, ref = workers
    batch = make_train_batch(ref, seed=8)
    batch.tensors["advantages"][0, 4] = float("nan")
    before = {n: t.clone() for n, t in meg.named_weights()}
    metrics = meg.train_mini_batch(batch, compute_norm(batch))
    assert metrics["train/skipped_step"] == 1.0 and metrics["train/grad_norm"] != metrics["train/grad_norm"]
    _assert_weights_equal(dict(meg.named_weights()), before, atol=0)


def test_offload_onload_keep_cpu_results(workers):
    meg, _ = workers
    batch = make_batch(seed=5)
    before = meg.forward(batch)
    meg.offload()
    during = meg.forward(batch)  # on the CPU there is nothing to move: the worker keeps serving
    meg.onload()
    after = meg.forward(batch)
    for out in (during, after):
        torch.testing.assert_close(out["logprobs"], before["logprobs"], rtol=0, atol=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(worker) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in worker.named_weights()}


def _multi_rank_job(rank: int, ports: list[int], hf_dir: str, batches: list[Batch], out: str) -> None:
    """Phases of one of four ranks; each phase leaves its process group before the next starts."""
    host = PluginHost.create([])
    first, second = batches
    result: dict = {}

    def worker(port: int, world: int = 2, **backend_args):
        return plugin.create_train_worker(TrainWorkerContext(
            job=make_job(hf_dir, **backend_args), components=host, rank=rank, world_size=world, master_port=port))

    # TP = 2 x PP = 2 on four ranks: forward, export, one training step on the whole batch.
    w = worker(ports[4], world=4, tp=2, pp=2)
    result["tppp_forward"] = w.forward(make_batch())
    result["tppp_initial"] = _weights(w)
    result["tppp_metrics"] = w.train_mini_batch(first, compute_norm(first))
    result["tppp_weights"] = _weights(w)
    w.close()
    if rank >= 2:
        torch.save(result, str(Path(out) / f"rank{rank}.pt"))
        return

    # TP = 2: forward, then one training step on the whole batch.
    w = worker(ports[0], tp=2)
    result["tp_forward"] = w.forward(make_batch())
    result["tp_initial"] = _weights(w)
    result["tp_metrics"] = w.train_mini_batch(first, compute_norm(first))
    result["tp_weights"] = _weights(w)
    w.close()

    # DP = 2: each rank trains on its half of the rows with the whole batch's norm; checkpoint
    # after the first step, then a second step (the uninterrupted run).
    def half(batch: Batch) -> Batch:
        return list(batch.chunks(len(batch) // 2))[rank]

    w = worker(ports[1], dp=2)
    result["dp_metrics"] = w.train_mini_batch(half(first), compute_norm(first))
    result["dp_weights"] = _weights(w)
    w.save_checkpoint(str(Path(out) / "ckpt"))
    result["dp_metrics_2"] = w.train_mini_batch(half(second), compute_norm(second))
    result["dp_weights_2"] = _weights(w)
    w.close()

    # A fresh DP = 2 run resumed from the checkpoint takes the second step again.
    w = worker(ports[2], dp=2)
    w.load_checkpoint(str(Path(out) / "ckpt"))
    result["resumed_metrics_2"] = w.train_mini_batch(half(second), compute_norm(second))
    result["resumed_weights_2"] = _weights(w)
    w.close()

    # PP = 2: rank 0 holds the embedding and the first layer, rank 1 the second layer, the final
    # norm and the (tied) output layer. Forward, export, one step through the 1F1B schedule (two
    # micro-batches), then the Hugging Face directory written by both stages together.
    w = worker(ports[3], pp=2)
    result["pp_stage_params"] = sorted(n for n, _ in w.modules[0].named_parameters())
    result["pp_forward"] = w.forward(make_batch())
    result["pp_forward_3"] = w.forward(make_batch(rows=3, seed=3))  # the second micro-batch is padded
    result["pp_initial"] = _weights(w)
    result["pp_metrics"] = w.train_mini_batch(first, compute_norm(first))
    result["pp_weights"] = _weights(w)
    w.save_hf(str(Path(out) / "pp_hf"))
    try:  # the two stages given different rows: a clear error on both, not a hung pipeline
        w.forward(make_batch(rows=2 + rank))
    except ValueError as exc:
        result["pp_mismatch_error"] = str(exc)
    w.close()

    # PP = 1, DP = 1 on rank 0 alone: the same forward and first step on the whole batch.
    if rank == 0:
        w = worker(0, world=1)
        result["dp1_forward"] = w.forward(make_batch())
        result["dp1_forward_3"] = w.forward(make_batch(rows=3, seed=3))
        result["dp1_initial"] = _weights(w)
        result["dp1_metrics"] = w.train_mini_batch(first, compute_norm(first))
        result["dp1_weights"] = _weights(w)
        w.close()
    torch.save(result, str(Path(out) / f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def multi_rank(hf_dir, host, tmp_path_factory):
    """Run :func:`_multi_rank_job` on four spawned ranks; returns (rank results, torch reference results,
    output directory)."""
    import torch.multiprocessing as mp

    # A fresh torch worker (the module's workers may have trained already) gives the batches'
    # old log-probs, the untouched weights and the torch backend's first step.
    ref = create_torch_worker(TrainWorkerContext(job=make_job(hf_dir), components=host))
    expected = {"forward": ref.forward(make_batch()), "initial": _weights(ref)}
    batches = [make_train_batch(ref, seed=6), make_train_batch(ref, seed=7)]
    out = tmp_path_factory.mktemp("multi_rank")
    ports = [_free_port() for _ in range(5)]
    mp.start_processes(_multi_rank_job, args=(ports, hf_dir, batches, str(out)), nprocs=4, join=True,
                       start_method="spawn")
    expected["metrics"] = ref.train_mini_batch(batches[0], compute_norm(batches[0]))
    expected["weights"] = dict(ref.named_weights())
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]
    return ranks, expected, out


def _assert_weights_equal(got: dict, expected: dict, atol: float) -> None:
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=atol, msg=name)


def test_tensor_parallel_2_equals_tp_1(multi_rank):
    (rank0, *_), expected, _ = multi_rank
    torch.testing.assert_close(rank0["tp_forward"]["logprobs"], expected["forward"]["logprobs"], rtol=0, atol=1e-5)
    _assert_weights_equal(rank0["tp_initial"], expected["initial"], atol=0)  # export gathers the TP shards
    # One training step under TP = 2 (gradient norm over the TP shards, QK-norm gradients summed
    # over the TP group by Megatron) matches the torch backend like the TP = 1 step does.
    got, ref = rank0["tp_metrics"], expected["metrics"]
    assert got["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=1e-4)
    for key in ("train/loss", "train/pg_loss", "train/entropy"):  # reported once per TP group
        assert got[key] == pytest.approx(ref[key], rel=1e-4), key
    assert got["train/lr"] == ref["train/lr"]
    diff = torch.cat([(rank0["tp_weights"][n] - t).abs().flatten() for n, t in expected["weights"].items()])
    assert diff.mean() < 1e-5


def test_data_parallel_2_equals_dp_1(multi_rank):
    (rank0, rank1, *_), expected, _ = multi_rank
    # Megatron DDP sums the two ranks' gradients: the step is the DP = 1 step on the whole batch.
    assert rank0["dp_metrics"]["train/grad_norm"] == rank0["dp1_metrics"]["train/grad_norm"]
    assert rank0["dp_metrics"]["train/grad_norm"] > 0
    for key in ("train/loss", "train/pg_loss", "train/entropy"):
        assert rank0["dp_metrics"][key] == pytest.approx(rank0["dp1_metrics"][key], rel=1e-6), key
    _assert_weights_equal(rank0["dp_weights"], rank0["dp1_weights"], atol=0)
    _assert_weights_equal(rank1["dp_weights"], rank0["dp_weights"], atol=0)  # replicas stay identical
    moved = torch.cat([(rank0["dp_weights"][n] - t).abs().flatten() for n, t in expected["initial"].items()])
    assert moved.max() > 1e-4


def test_checkpoint_resume_continues_exactly(multi_rank):
    (rank0, rank1, *_), _, _ = multi_rank
    for rank in (rank0, rank1):
        assert rank["resumed_metrics_2"] == rank["dp_metrics_2"]
        _assert_weights_equal(rank["resumed_weights_2"], rank["dp_weights_2"], atol=0)  # bit-equal
    # The second step trained at the warmed-up learning rate with the saved Adam moments.
    assert rank0["dp_metrics_2"]["train/lr"] > rank0["dp_metrics"]["train/lr"]
    step = torch.cat([(rank0["dp_weights_2"][n] - t).abs().flatten() for n, t in rank0["dp_weights"].items()])
    assert step.max() > 1e-4


def test_pipeline_parallel_2_equals_pp_1(multi_rank, hf_dir):
    from safetensors.torch import load_file

    (rank0, rank1, *_), _, out = multi_rank
    # Each stage holds only its own layers (built by Megatron-Bridge with pre/post_process).
    first, last = rank0["pp_stage_params"], rank1["pp_stage_params"]
    assert any(n.startswith("embedding.") for n in first) and not any(n.startswith("output_layer.") for n in first)
    assert any(n.startswith("output_layer.") for n in last) and not any(n.startswith("embedding.") for n in last)
    for names in (first, last):  # one of the two transformer layers each
        assert {n.split(".")[2] for n in names if n.startswith("decoder.layers.")} == {"0"}
    # Forward: the last stage's log-probs, broadcast to both stages, equal PP = 1's.
    for rank in (rank0, rank1):
        for key in ("logprobs", "entropy"):
            torch.testing.assert_close(rank["pp_forward"][key], rank0["dp1_forward"][key], rtol=0, atol=1e-5)
            torch.testing.assert_close(rank["pp_forward_3"][key], rank0["dp1_forward_3"][key], rtol=0, atol=1e-5)
        # Export gathers the stages' weights: the same full Hugging Face state dict as PP = 1.
        _assert_weights_equal(rank["pp_initial"], rank0["dp1_initial"], atol=0)
    # One GRPO step through the 1F1B schedule: same loss, gradient norm and updated weights.
    got, ref = rank0["pp_metrics"], rank0["dp1_metrics"]
    assert rank1["pp_metrics"] == got  # every stage reports the last stage's metrics
    assert got["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=1e-6)
    for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/entropy", "train/lr"):
        assert got[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-7), key
    for rank in (rank0, rank1):
        _assert_weights_equal(rank["pp_weights"], rank0["dp1_weights"], atol=1e-5)
    moved = torch.cat([(rank0["pp_weights"][n] - t).abs().flatten() for n, t in rank0["pp_initial"].items()])
    assert moved.max() > 1e-4
    for rank in (rank0, rank1):
        assert "must receive the same rows" in rank["pp_mismatch_error"]
        assert "shapes by rank: ['2x12', '3x12']" in rank["pp_mismatch_error"]
    # save_hf under PP = 2 writes the trained full weights (every tensor of the source checkpoint)
    # once, from both stages.
    saved = load_file(str(out / "pp_hf" / "model.safetensors"))
    assert set(saved) == set(load_file(str(Path(hf_dir) / "model.safetensors")))
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, rank0["pp_weights"][name], rtol=0, atol=0, msg=name)


def test_tensor_parallel_2_by_pipeline_parallel_2_equals_one_rank(multi_rank):
    ranks, _, _ = multi_rank
    ref = ranks[0]
    for rank in ranks:  # each rank returns the full outputs, metrics and weights
        for key in ("logprobs", "entropy"):
            torch.testing.assert_close(rank["tppp_forward"][key], ref["dp1_forward"][key], rtol=0, atol=1e-5)
        _assert_weights_equal(rank["tppp_initial"], ref["dp1_initial"], atol=0)
        got = rank["tppp_metrics"]
        assert got["train/grad_norm"] == pytest.approx(ref["dp1_metrics"]["train/grad_norm"], rel=1e-5)
        for key in ("train/loss", "train/pg_loss", "train/entropy"):
            assert got[key] == pytest.approx(ref["dp1_metrics"][key], rel=1e-5), key
        _assert_weights_equal(rank["tppp_weights"], ref["dp1_weights"], atol=1e-5)


def test_bad_backend_args_raise_clear_errors(hf_dir, host):
    with pytest.raises(ValueError, match=r"backend_args.pp = 4: the model's 2 layers do not split evenly"):
        plugin.create_train_worker(TrainWorkerContext(job=make_job(hf_dir, pp=4), components=host, world_size=4))
    with pytest.raises(ValueError, match=r"3 ranks are not divisible by tp \* pp = 2"):
        plugin.create_train_worker(TrainWorkerContext(job=make_job(hf_dir, pp=2), components=host, world_size=3))
    with pytest.raises(ValueError, match="unknown keys"):
        plugin.create_train_worker(TrainWorkerContext(job=make_job(hf_dir, bogus=1), components=host))
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        plugin.create_train_worker(TrainWorkerContext(job=make_job(hf_dir, use_distributed_optimizer="yes"),
                                                      components=host))
    # Megatron-Core's distributed optimizer only shards CUDA tensors: a clear error without CUDA.
    with pytest.raises(ValueError, match=r"use_distributed_optimizer = true cannot run here: .*needs CUDA"):
        plugin.create_train_worker(TrainWorkerContext(job=make_job(hf_dir, use_distributed_optimizer=True),
                                                      components=host))
