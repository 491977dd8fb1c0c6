"""The megatron train backend against the torch backend on the same tiny Qwen3 weights (LoRA
included), and on a tiny Qwen3-MoE against transformers and across expert-parallel sizes (CPU).

The multi-rank checks (TP=2 x PP=2, EP=2 x PP=2, TP=2, DP=2, checkpoint resume, PP=2, EP=2) share
one spawned set of four processes (``multi_rank`` fixture) that runs them as successive phases,
each with its own process group: all four ranks in the first two phases, ranks 0 and 1 in the
two-rank phases after them, rank 0 alone for the one-rank references.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

try:
    import megatron.core  # noqa: F401
except ImportError as exc:  # fail, never skip: the backend's tests need the real library
    raise ImportError("megatron-core is not installed: pip install -r requirements-megatron.txt") from exc

from loongsage_plugin_megatron import plugin
from loongsage_plugin_megatron.checkpoint import STATE_FILE
from loongsage_plugin_torch.trainer import create_train_worker as create_torch_worker
from megatron_test_support import (
    TINY_QWEN3_MOE,
    TOKENIZER,
    assert_weights_equal,
    hf_token_outputs,
    make_batch,
    make_job,
    make_train_batch,
    rendezvous_ports,
    run_ranks,
    save_tiny_moe,
    weights_of,
    with_hf_old_logprobs,
)

from loongsage_core.algorithms import compute_norm
from loongsage_core.config import AlgorithmConfig, JobConfig, LoraConfig, ModelConfig, TrainConfig
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import Batch, LoraTrainer, TrainWorker, TrainWorkerContext


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """(Hugging Face directory, transformers ``Qwen3MoeForCausalLM`` with the same weights)."""
    out = str(tmp_path_factory.mktemp("tiny_qwen3_moe"))
    return out, save_tiny_moe(out)


def make_moe_train_batch(model, seed: int) -> Batch:
    """A GRPO batch whose ``old_logprobs`` are the MoE model's log-probs plus a little noise."""
    return with_hf_old_logprobs(model, make_batch(seed=seed), seed)


@pytest.fixture
def workers(hf_dir, host):
    """A fresh Megatron worker and the torch worker it must equal, on the same checkpoint: each
    test gets its own pair, so a test that trains one of them cannot change what the next sees."""
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
    assert_weights_equal(dict(meg.named_weights()), before, atol=0)


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


def _multi_rank_job(rank: int, out: str, hf_dir: str, batches: list[Batch], moe: tuple[str, Batch]) -> dict:
    """Phases of one of four ranks; each phase leaves its process group before the next starts
    and the next joins a rendezvous of its own. Returns the rank's results."""
    ports, _listening = rendezvous_ports(rank, out, 7)
    host = PluginHost.create([])
    first, second = batches
    moe_dir, moe_batch = moe
    result: dict = {}

    def worker(port: int, world: int = 2, path: str = hf_dir, **backend_args):
        return plugin.create_train_worker(TrainWorkerContext(
            job=make_job(path, **backend_args), components=host, rank=rank, world_size=world, master_port=port))

    # TP = 2 x PP = 2 on four ranks: forward, export, one training step on the whole batch.
    w = worker(ports[4], world=4, tp=2, pp=2)
    result["tppp_forward"] = w.forward(make_batch())
    result["tppp_initial"] = weights_of(w)
    result["tppp_metrics"] = w.train_mini_batch(first, compute_norm(first))
    result["tppp_weights"] = weights_of(w)
    w.close()

    # EP = 2 x PP = 2 on four ranks (the MoE model): ranks 0 and 1 hold the first layer, 2 and 3 the
    # second; data-parallel replica r (ranks r and r + 2) gets rows 0-2 or row 3 of the batch.
    w = worker(ports[6], world=4, path=moe_dir, ep=2, pp=2)
    result["eppp_forward"] = w.forward(make_batch())
    result["eppp_initial"] = weights_of(w)
    mine = moe_batch.select([0, 1, 2] if w.data_parallel_rank == 0 else [3])
    result["eppp_metrics"] = w.train_mini_batch(mine, compute_norm(moe_batch))
    result["eppp_weights"] = weights_of(w)
    w.close()
    if rank >= 2:
        return result

    # TP = 2: forward, then one training step on the whole batch.
    w = worker(ports[0], tp=2)
    result["tp_forward"] = w.forward(make_batch())
    result["tp_initial"] = weights_of(w)
    result["tp_metrics"] = w.train_mini_batch(first, compute_norm(first))
    result["tp_weights"] = weights_of(w)
    w.close()

    # DP = 2: each rank trains on its half of the rows with the whole batch's norm; checkpoint
    # after the first step, then a second step (the uninterrupted run).
    def half(batch: Batch) -> Batch:
        return list(batch.chunks(len(batch) // 2))[rank]

    w = worker(ports[1], dp=2)
    result["dp_metrics"] = w.train_mini_batch(half(first), compute_norm(first))
    result["dp_weights"] = weights_of(w)
    w.save_checkpoint(str(Path(out) / "ckpt"))
    result["dp_metrics_2"] = w.train_mini_batch(half(second), compute_norm(second))
    result["dp_weights_2"] = weights_of(w)
    w.close()

    # A fresh DP = 2 run resumed from the checkpoint takes the second step again.
    w = worker(ports[2], dp=2)
    w.load_checkpoint(str(Path(out) / "ckpt"))
    result["resumed_metrics_2"] = w.train_mini_batch(half(second), compute_norm(second))
    result["resumed_weights_2"] = weights_of(w)
    w.close()

    # PP = 2: rank 0 holds the embedding and the first layer, rank 1 the second layer, the final
    # norm and the (tied) output layer. Forward, export, one step through the 1F1B schedule (two
    # micro-batches), then the Hugging Face directory written by both stages together.
    w = worker(ports[3], pp=2)
    result["pp_stage_params"] = sorted(n for n, _ in w.modules[0].named_parameters())
    result["pp_forward"] = w.forward(make_batch())
    result["pp_forward_3"] = w.forward(make_batch(rows=3, seed=3))  # the second micro-batch is padded
    result["pp_initial"] = weights_of(w)
    result["pp_metrics"] = w.train_mini_batch(first, compute_norm(first))
    result["pp_weights"] = weights_of(w)
    w.save_hf(str(Path(out) / "pp_hf"))
    try:  # the two stages given different rows: a clear error on both, not a hung pipeline
        w.forward(make_batch(rows=2 + rank))
    except ValueError as exc:
        result["pp_mismatch_error"] = str(exc)
    w.close()

    # EP = 2 (DP = 2) on the tiny Qwen3-MoE: each rank holds two of every layer's four experts.
    w = worker(ports[5], path=moe_dir, ep=2)
    params = dict(w.modules[0].named_parameters())
    result["ep_local_experts"] = {name: t.detach().clone() for name, t in params.items() if ".local_experts." in name}
    result["ep_forward"] = w.forward(make_batch())
    # Different rows on the two ranks (3 and none): they agree on one shape and number of micro-batches.
    result["ep_forward_uneven"] = w.forward(make_batch(rows=3, seed=3) if rank == 0 else make_batch().select([]))
    result["ep_initial"] = weights_of(w)
    # One GRPO step on the whole batch split unevenly (3 rows and 1: two micro-batches against one
    # and an all-padding one), with the whole batch's norm.
    mine = moe_batch.select([0, 1, 2] if rank == 0 else [3])
    result["ep_metrics"] = w.train_mini_batch(mine, compute_norm(moe_batch))
    result["ep_weights"] = weights_of(w)
    w.close()

    # PP = 1, DP = 1 on rank 0 alone: the same forward and first step on the whole batch.
    if rank == 0:
        w = worker(0, world=1)
        result["dp1_forward"] = w.forward(make_batch())
        result["dp1_forward_3"] = w.forward(make_batch(rows=3, seed=3))
        result["dp1_initial"] = weights_of(w)
        result["dp1_metrics"] = w.train_mini_batch(first, compute_norm(first))
        result["dp1_weights"] = weights_of(w)
        w.close()
        # EP = 1 on the MoE model: the reference of the EP = 2 phase.
        w = worker(0, world=1, path=moe_dir)
        result["ep1_forward"] = w.forward(make_batch())
        result["ep1_forward_3"] = w.forward(make_batch(rows=3, seed=3))
        result["ep1_initial"] = weights_of(w)
        result["ep1_metrics"] = w.train_mini_batch(moe_batch, compute_norm(moe_batch))
        result["ep1_weights"] = weights_of(w)
        w.close()
    return result


@pytest.fixture(scope="module")
def multi_rank(slow_fixture, hf_dir, moe_model, host, tmp_path_factory):
    """Run :func:`_multi_rank_job` on four spawned ranks; returns (rank results, torch reference results,
    output directory)."""
    # A fresh torch worker (the module's workers may have trained already) gives the batches'
    # old log-probs, the untouched weights and the torch backend's first step.
    ref = create_torch_worker(TrainWorkerContext(job=make_job(hf_dir), components=host))
    expected = {"forward": ref.forward(make_batch()), "initial": weights_of(ref)}
    batches = [make_train_batch(ref, seed=6), make_train_batch(ref, seed=7)]
    out = tmp_path_factory.mktemp("multi_rank")
    moe = (moe_model[0], make_moe_train_batch(moe_model[1], seed=6))
    ranks = run_ranks(_multi_rank_job, 4, out, hf_dir, batches, moe)
    expected["metrics"] = ref.train_mini_batch(batches[0], compute_norm(batches[0]))
    expected["weights"] = dict(ref.named_weights())
    return ranks, expected, out


def test_tensor_parallel_2_equals_tp_1(multi_rank):
    (rank0, *_), expected, _ = multi_rank
    torch.testing.assert_close(rank0["tp_forward"]["logprobs"], expected["forward"]["logprobs"], rtol=0, atol=1e-5)
    assert_weights_equal(rank0["tp_initial"], expected["initial"], atol=0)  # export gathers the TP shards
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
    assert_weights_equal(rank0["dp_weights"], rank0["dp1_weights"], atol=0)
    assert_weights_equal(rank1["dp_weights"], rank0["dp_weights"], atol=0)  # replicas stay identical
    moved = torch.cat([(rank0["dp_weights"][n] - t).abs().flatten() for n, t in expected["initial"].items()])
    assert moved.max() > 1e-4


def test_checkpoint_resume_continues_exactly(multi_rank):
    (rank0, rank1, *_), _, _ = multi_rank
    for rank in (rank0, rank1):
        assert rank["resumed_metrics_2"] == rank["dp_metrics_2"]
        assert_weights_equal(rank["resumed_weights_2"], rank["dp_weights_2"], atol=0)  # bit-equal
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
        assert_weights_equal(rank["pp_initial"], rank0["dp1_initial"], atol=0)
    # One GRPO step through the 1F1B schedule: same loss, gradient norm and updated weights.
    got, ref = rank0["pp_metrics"], rank0["dp1_metrics"]
    assert rank1["pp_metrics"] == got  # every stage reports the last stage's metrics
    assert got["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=1e-6)
    for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/entropy", "train/lr"):
        assert got[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-7), key
    for rank in (rank0, rank1):
        assert_weights_equal(rank["pp_weights"], rank0["dp1_weights"], atol=1e-5)
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


def test_expert_parallel_2_equals_ep_1(multi_rank, moe_model):
    (rank0, rank1, *_), _, _ = multi_rank
    source = _source_weights(moe_model[0])
    # Each rank loaded its own experts: rank r's local expert i is Hugging Face expert 2r + i.
    for r, rank in enumerate((rank0, rank1)):
        names = rank["ep_local_experts"]
        assert {n.split(".local_experts.")[1].split(".")[0] for n in names} == {"0", "1"}
        for layer in (0, 1):
            for local in (0, 1):
                prefix = f"decoder.layers.{layer}.mlp.experts.local_experts.{local}"
                hf = f"model.layers.{layer}.mlp.experts.{2 * r + local}"
                fc1 = torch.cat([source[f"{hf}.gate_proj.weight"], source[f"{hf}.up_proj.weight"]])
                torch.testing.assert_close(names[f"{prefix}.linear_fc1.weight"], fc1, rtol=0, atol=0)
                torch.testing.assert_close(names[f"{prefix}.linear_fc2.weight"], source[f"{hf}.down_proj.weight"],
                                           rtol=0, atol=0)
    for rank in (rank0, rank1):
        for key in ("logprobs", "entropy"):
            torch.testing.assert_close(rank["ep_forward"][key], rank0["ep1_forward"][key], rtol=0, atol=1e-5)
        # Export gathers every rank's experts: the source checkpoint, as under EP = 1.
        assert_weights_equal(rank["ep_initial"], source, atol=0)
        assert_weights_equal(rank0["ep1_initial"], source, atol=0)
    torch.testing.assert_close(rank0["ep_forward_uneven"]["logprobs"], rank0["ep1_forward_3"]["logprobs"],
                               rtol=0, atol=1e-5)
    assert rank1["ep_forward_uneven"]["logprobs"].shape == (0, 12)
    # One GRPO step: the EP = 1 step on the whole batch (expert gradients come back from the
    # other rank's tokens, dense gradients are summed over DP); the experts' weights moved.
    got, ref = rank0["ep_metrics"], rank0["ep1_metrics"]
    assert rank1["ep_metrics"]["train/grad_norm"] == got["train/grad_norm"]
    assert got["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=1e-5)
    for key in ("train/loss", "train/pg_loss", "train/entropy_loss", "train/entropy", "train/lr"):
        assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key
    for rank in (rank0, rank1):
        assert_weights_equal(rank["ep_weights"], rank0["ep1_weights"], atol=1e-5)
    moved = {n: (rank0["ep_weights"][n] - t).abs().max() for n, t in source.items()}
    assert all(moved[n] > 1e-4 for n in moved if ".mlp.experts." in n)


def test_expert_parallel_2_by_pipeline_parallel_2_equals_one_rank(multi_rank, moe_model):
    ranks, _, _ = multi_rank
    ref = ranks[0]
    source = _source_weights(moe_model[0])
    for rank in ranks:
        for key in ("logprobs", "entropy"):
            torch.testing.assert_close(rank["eppp_forward"][key], ref["ep1_forward"][key], rtol=0, atol=1e-5)
        assert_weights_equal(rank["eppp_initial"], source, atol=0)
        got = rank["eppp_metrics"]
        assert got["train/grad_norm"] == pytest.approx(ref["ep1_metrics"]["train/grad_norm"], rel=1e-5)
        for key in ("train/loss", "train/pg_loss", "train/entropy"):
            assert got[key] == pytest.approx(ref["ep1_metrics"][key], rel=1e-5), key
        assert_weights_equal(rank["eppp_weights"], ref["ep1_weights"], atol=1e-5)


def test_tensor_parallel_2_by_pipeline_parallel_2_equals_one_rank(multi_rank):
    ranks, _, _ = multi_rank
    ref = ranks[0]
    for rank in ranks:  # each rank returns the full outputs, metrics and weights
        for key in ("logprobs", "entropy"):
            torch.testing.assert_close(rank["tppp_forward"][key], ref["dp1_forward"][key], rtol=0, atol=1e-5)
        assert_weights_equal(rank["tppp_initial"], ref["dp1_initial"], atol=0)
        got = rank["tppp_metrics"]
        assert got["train/grad_norm"] == pytest.approx(ref["dp1_metrics"]["train/grad_norm"], rel=1e-5)
        for key in ("train/loss", "train/pg_loss", "train/entropy"):
            assert got[key] == pytest.approx(ref["dp1_metrics"][key], rel=1e-5), key
        assert_weights_equal(rank["tppp_weights"], ref["dp1_weights"], atol=1e-5)


def test_moe_logprobs_and_export_equal_transformers(moe_model, host):
    path, hf = moe_model
    w = plugin.create_train_worker(TrainWorkerContext(job=make_job(path), components=host))
    # Without Transformer Engine the experts are Megatron-Core's SequentialMLP (local_experts.{i}).
    assert type(w.model.module.decoder.layers[0].mlp.experts).__name__ == "SequentialMLP"
    for batch in (make_batch(), make_batch(rows=3, seed=3)):
        got, expected = w.forward(batch), hf_token_outputs(hf, batch)
        for key in ("logprobs", "entropy"):
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-5)
    assert_weights_equal(dict(w.named_weights()), _source_weights(path), atol=0)


def test_moe_router_without_top_k_renormalisation_equals_transformers(tmp_path, host):
    # norm_topk_prob = false (transformers' default): experts weighted by their plain softmax
    # probabilities, which Megatron-Bridge's Qwen3-MoE translation does not carry over by itself.
    hf = save_tiny_moe(str(tmp_path), norm_topk_prob=False)
    w = plugin.create_train_worker(TrainWorkerContext(job=make_job(str(tmp_path)), components=host,
                                                      role="reference"))
    batch = make_batch()
    torch.testing.assert_close(w.forward(batch)["logprobs"], hf_token_outputs(hf, batch)["logprobs"],
                               rtol=0, atol=1e-5)
    assert w.model.config.moe_router_pre_softmax  # softmax over all experts, then the top 2


def test_moe_aux_loss_coeff_adds_the_mean_load_balancing_gradient(moe_model, host):
    """With ``moe_aux_loss_coeff`` > 0 the step's gradient is the RL loss's plus ``coeff`` times the
    gradient of every MoE layer's Switch load-balancing loss, averaged over the mini-batch's routed
    tokens (each micro-batch's loss weighted by its tokens), computed here independently."""
    import attrs
    from loongsage_plugin_megatron.forward_backward import stage_inputs, token_outputs

    path, hf = moe_model
    coeff = 0.5
    job = make_job(path, moe_aux_loss_coeff=coeff)
    job = attrs.evolve(job, train=attrs.evolve(job.train, grad_clip=1e9))  # compare unclipped gradients
    w = plugin.create_train_worker(TrainWorkerContext(job=job, components=host))
    batch = make_moe_train_batch(hf, seed=11)
    norm = compute_norm(batch)
    model = w.modules[0]
    params = [p for p in model.parameters() if p.requires_grad]
    routed: list = []
    hooks = [layer.mlp.router.register_forward_hook(lambda mod, args, out: routed.append((mod, args[0], out[1])))
             for layer in model.decoder.layers]
    inputs = stage_inputs(batch, w.micro_batch_size, torch.device("cpu"), fixed_shape=False)
    total_tokens = sum(i.input_ids.numel() for i in inputs)
    rl = aux = 0.0
    model.eval()  # the same forward (no dropout) without Megatron attaching its own aux loss
    for item in inputs:
        routed.clear()
        logits = model(input_ids=item.input_ids, position_ids=item.position_ids, attention_mask=item.attention_mask)
        logprobs, entropy = token_outputs(logits, item, tp=1, entropy_grad=True)
        rl = rl + w.pipeline.loss(item.micro, logprobs, entropy, norm)[0]
        for router, hidden, routing_map in routed:  # Switch loss: E / (k T^2) * sum_e count_e * sum_t p_te
            x = hidden.reshape(-1, hidden.shape[-1])
            probs = torch.softmax(x @ router.weight.t(), dim=-1)
            tokens, experts = probs.shape
            top_k = TINY_QWEN3_MOE["num_experts_per_tok"]
            switch = experts / (top_k * tokens**2) * (probs.sum(0) * routing_map.sum(0)).sum()
            aux = aux + switch * tokens / total_tokens
    for hook in hooks:
        hook.remove()
    expected = torch.autograd.grad(rl + coeff * aux, params, retain_graph=True)
    rl_only = torch.autograd.grad(rl, params)
    metrics = w.train_mini_batch(batch, norm)
    got = torch.cat([p.main_grad.flatten() for p in params])
    expected, rl_only = torch.cat([g.flatten() for g in expected]), torch.cat([g.flatten() for g in rl_only])
    assert (expected - rl_only).norm() > 0.05 * rl_only.norm()  # the load-balancing term shows
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert metrics["train/grad_norm"] == pytest.approx(float(expected.norm()), rel=1e-5)
    # The reported loss stays the host's RL loss.
    assert metrics["train/loss"] == pytest.approx(float(rl.detach()), rel=1e-5)


def test_bridge_orders_sequential_experts_by_number():
    from loongsage_plugin_megatron import bridge_compat, cpu_compat

    cpu_compat.import_bridge()  # Megatron-Bridge imports need the placeholders without Transformer Engine
    bridge_compat.apply()
    from megatron.bridge.models.conversion import model_bridge

    # Experts 8-15 of one expert-parallel rank, in the order every rank's export tasks must share.
    names = [f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc{k}.weight"
             for e in range(8, 16) for k in (1, 2)]
    names += ["decoder.layers.1.mlp.router.weight", "decoder.layers.0.mlp.experts.local_experts.9.linear_fc1.weight"]
    ordered = sorted(names, key=model_bridge.extract_sort_key)
    assert ordered[0] == "decoder.layers.0.mlp.experts.local_experts.9.linear_fc1.weight"
    assert ordered[1] == "decoder.layers.1.mlp.router.weight"
    assert ordered[2:] == names[:16]
    assert bridge_compat.sequential_expert(names[0]) == ("decoder.layers.1.mlp.experts", 8, "linear_fc1.weight")
    assert bridge_compat.sequential_expert("decoder.layers.1.mlp.experts.linear_fc1.weight8") is None


def _source_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


def test_bad_backend_args_raise_clear_errors(hf_dir, moe_model, host):
    import torch.distributed as dist

    had_group = dist.is_initialized()
    with pytest.raises(ValueError, match=r"backend_args.pp = 4: the model's 2 layers do not split evenly"):
        plugin.create_train_worker(TrainWorkerContext(job=make_job(hf_dir, pp=4), components=host, world_size=4))
    with pytest.raises(ValueError, match=r"3 ranks are not divisible by tp \* pp = 2"):
        plugin.create_train_worker(TrainWorkerContext(job=make_job(hf_dir, pp=2), components=host, world_size=3))
    with pytest.raises(ValueError, match="unknown keys"):
        plugin.create_train_worker(TrainWorkerContext(job=make_job(hf_dir, bogus=1), components=host))
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        plugin.create_train_worker(TrainWorkerContext(job=make_job(hf_dir, use_distributed_optimizer="yes"),
                                                      components=host))
    # Expert parallelism: a MoE model, ep dividing dp and the number of experts; MoE under tp > 1
    # needs sequence parallelism.
    with pytest.raises(ValueError, match=r"backend_args.ep = 2: expert parallelism needs a Mixture-of-Experts "
                                         r"model, but the model in \[model\] path is dense"):
        plugin.create_train_worker(TrainWorkerContext(job=make_job(hf_dir, ep=2), components=host, world_size=2))
    moe_dir = moe_model[0]
    with pytest.raises(ValueError, match=r"backend_args.ep = 2 must divide the data-parallel size dp = 1"):
        plugin.create_train_worker(TrainWorkerContext(job=make_job(moe_dir, ep=2, pp=2), components=host,
                                                      world_size=2))
    with pytest.raises(ValueError, match=r"backend_args.ep = 3 must divide the model's 4 experts"):
        plugin.create_train_worker(TrainWorkerContext(job=make_job(moe_dir, ep=3), components=host, world_size=3))
    with pytest.raises(ValueError, match=r"backend_args.ep must be >= 1, got 0"):
        plugin.create_train_worker(TrainWorkerContext(job=make_job(moe_dir, ep=0), components=host))
    with pytest.raises(ValueError, match=r"backend_args.tp = 2 with sequence_parallel = false: Mixture-of-Experts "
                                         r"models need sequence parallelism"):
        plugin.create_train_worker(TrainWorkerContext(job=make_job(moe_dir, tp=2, sequence_parallel=False),
                                                      components=host, world_size=2))
    with pytest.raises(ValueError, match=r"moe_aux_loss_coeff = 0.1: the model in \[model\] path is dense"):
        plugin.create_train_worker(TrainWorkerContext(job=make_job(hf_dir, moe_aux_loss_coeff=0.1), components=host))
    with pytest.raises(ValueError, match=r"backend_args: 'moe_aux_loss_coeff' must be >= 0"):
        plugin.create_train_worker(TrainWorkerContext(job=make_job(moe_dir, moe_aux_loss_coeff=-1), components=host))
    # Megatron-Core's distributed optimizer only shards CUDA tensors: a clear error without CUDA.
    with pytest.raises(ValueError, match=r"use_distributed_optimizer = true cannot run here: .*needs CUDA"):
        plugin.create_train_worker(TrainWorkerContext(job=make_job(hf_dir, use_distributed_optimizer=True),
                                                      components=host))
    # a worker that failed after joining the process group left it (it would break the next worker)
    assert dist.is_initialized() == had_group


def test_an_update_that_overflows_the_weights_is_reported_for_the_host_to_stop(workers):
    """The megatron backend does not roll such a step back (documented): it reports it, and the
    host's bad-step check ends the run before the weights reach the engines."""
    from loongsage_core.controller.health import StepHealth, TrainingFailedError

    meg, ref = workers
    batch = make_train_batch(ref, seed=4)
    assert meg.train_mini_batch(batch, compute_norm(batch))["train/nonfinite_weights"] == 0.0
    for group in meg.optimizer.param_groups:
        group["lr"] = 1e39  # finite, but the Adam update overflows float32
    batch = make_train_batch(ref, seed=5)
    metrics = meg.train_mini_batch(batch, compute_norm(batch))
    assert metrics["train/nonfinite_weights"] >= 1.0 and metrics.get("train/rolled_back_step", 0.0) == 0.0
    with pytest.raises(TrainingFailedError, match="weights became non-finite .* did not roll the step back"):
        StepHealth(3).observe(1, metrics, [])


# -- LoRA (Megatron-Bridge's PEFT) against LoRA on the torch backend (PEFT), same adapter weights --

# Where Megatron-Bridge's CanonicalLoRA keeps the adapter of each Hugging Face projection: written
# out here, independently of the backend, so the test also checks the backend's export names.
MEGATRON_ADAPTER = {"q_proj": "self_attention.linear_qkv.adapter.adapter_q",
                    "k_proj": "self_attention.linear_qkv.adapter.adapter_k",
                    "v_proj": "self_attention.linear_qkv.adapter.adapter_v",
                    "o_proj": "self_attention.linear_proj.adapter",
                    "gate_proj": "mlp.linear_fc1.adapter.adapter_gate",
                    "up_proj": "mlp.linear_fc1.adapter.adapter_up",
                    "down_proj": "mlp.linear_fc2.adapter"}


def megatron_name(peft_name: str) -> str:
    """``base_model.model.model.layers.I.<attn|mlp>.PROJ.lora_<A|B>.weight`` -> Megatron parameter name."""
    parts = peft_name.split(".")
    layer, proj, factor = parts[4], parts[6], parts[7]
    linear = "linear_in" if factor == "lora_A" else "linear_out"
    return f"decoder.layers.{layer}.{MEGATRON_ADAPTER[proj]}.{linear}.weight"


def lora_job(path: str, **lora) -> JobConfig:
    return JobConfig(model=ModelConfig(path=path, tokenizer=TOKENIZER),
                     train=TrainConfig(lr=1e-2, micro_batch_size=2, grad_clip=1.0, lr_schedule="cosine",
                                       lr_warmup_steps=2, total_steps=6, weight_decay=0.01,
                                       lora=LoraConfig(**{"rank": 4, "alpha": 8.0, **lora})),
                     algorithm=AlgorithmConfig(entropy_coef=0.01))


def megatron_worker(job: JobConfig, host: PluginHost):
    backends = {s.name: s for s in plugin.loongsage_train_backends()}
    assert backends["megatron"].supports_lora
    return backends["megatron"].factory(TrainWorkerContext(job=job, components=host))


@pytest.fixture
def lora_workers(hf_dir, host):
    """A Megatron LoRA worker and a torch LoRA worker holding the same adapter: the torch one's
    Kaiming-initialised ``A`` and a random non-zero ``B`` (so the adapter changes the outputs)."""
    meg = megatron_worker(lora_job(hf_dir), host)
    ref = create_torch_worker(TrainWorkerContext(job=lora_job(hf_dir), components=host))
    g = torch.Generator().manual_seed(7)
    params = dict(meg.modules[0].named_parameters())
    with torch.no_grad():
        for name, tensor in ref.named_weights():  # live adapter tensors of the PEFT model
            if name.endswith("lora_B.weight"):
                tensor.copy_(0.05 * torch.randn(tensor.shape, generator=g))
            params[megatron_name(name)].copy_(tensor)
    yield meg, ref
    meg.close()


def test_the_adapter_is_exported_under_peft_names(lora_workers):
    meg, ref = lora_workers
    assert isinstance(meg, LoraTrainer) and meg.serves_reference
    exported, expected = dict(meg.named_weights()), dict(ref.named_weights())
    assert set(exported) == set(expected) and len(expected) == 2 * 7 * 2  # A and B, 7 projections, 2 layers
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)


def test_lora_logprobs_reference_and_step_match_torch_lora(lora_workers):
    meg, ref = lora_workers
    batch = make_batch(seed=3)
    adapted, base = meg.forward(batch), meg.reference_forward(batch)
    torch.testing.assert_close(adapted["logprobs"], ref.forward(batch)["logprobs"], rtol=0, atol=1e-5)
    torch.testing.assert_close(base["logprobs"], ref.reference_forward(batch)["logprobs"], rtol=0, atol=1e-5)
    assert (adapted["logprobs"] - base["logprobs"]).abs().max() > 1e-3  # the adapter matters; disabled it is off
    torch.testing.assert_close(meg.forward(batch)["logprobs"], adapted["logprobs"], rtol=0, atol=0)  # back on

    frozen = {n: p.detach().clone() for n, p in meg.modules[0].named_parameters() if not p.requires_grad}
    trained = sum(p.numel() for p in meg.modules[0].parameters() if p.requires_grad)
    assert trained == sum(t.numel() for _, t in ref.named_weights())  # the adapter, nothing else
    step = make_train_batch(ref, seed=1)
    norm = compute_norm(step)
    m_meg, m_ref = meg.train_mini_batch(step, norm), ref.train_mini_batch(step, norm)
    assert m_meg["train/grad_norm"] > 0
    assert m_meg["train/grad_norm"] == pytest.approx(m_ref["train/grad_norm"], rel=1e-4)
    assert m_meg["train/loss"] == pytest.approx(m_ref["train/loss"], rel=1e-4, abs=1e-6)
    after, moved = dict(meg.named_weights()), dict(ref.named_weights())
    assert any((after[n] - t).abs().max() > 0 for n, t in moved.items())
    diff = torch.cat([(after[n] - t).abs().flatten() for n, t in moved.items()])
    assert diff.mean() < 1e-5  # both adapters moved alike
    for name, param in meg.modules[0].named_parameters():
        if name in frozen:
            assert torch.equal(param, frozen[name]), name  # the base weights did not move


def test_adapter_directory_and_merged_export_give_the_workers_logprobs(lora_workers, hf_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    meg, _ = lora_workers
    batch = make_batch(seed=5)
    want = meg.forward(batch)["logprobs"]
    meg.save_adapter(str(tmp_path / "adapter"))
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                     "adapter_model.safetensors"]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
                                           str(tmp_path / "adapter")).eval()
    torch.testing.assert_close(hf_token_outputs(peft_model, batch)["logprobs"], want, rtol=0, atol=1e-5)
    meg.save_hf(str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    torch.testing.assert_close(hf_token_outputs(merged, batch)["logprobs"], want, rtol=0, atol=1e-5)


def test_lora_checkpoint_holds_the_adapter_and_resumes_exactly(hf_dir, host, tmp_path):
    first = megatron_worker(lora_job(hf_dir), host)
    try:
        first.train_mini_batch(b1 := make_train_batch(first, seed=1), compute_norm(b1))
        first.save_checkpoint(str(tmp_path / "ckpt"))
        b2 = make_train_batch(first, seed=2)
        first.train_mini_batch(b2, compute_norm(b2))
        want = dict(first.named_weights())
    finally:
        first.close()
    saved = torch.load(tmp_path / "ckpt" / STATE_FILE.format(rank=0), weights_only=False)
    assert saved["adapter_only"] and saved["model"] and all(".adapter." in k for k in saved["model"])
    resumed = megatron_worker(lora_job(hf_dir, rank=8), host)
    try:  # another adapter shape: a clear error, nothing loaded
        with pytest.raises(ValueError, match="holds another adapter than this job's"):
            resumed.load_checkpoint(str(tmp_path / "ckpt"))
    finally:
        resumed.close()
    resumed = megatron_worker(lora_job(hf_dir), host)
    try:
        resumed.load_checkpoint(str(tmp_path / "ckpt"))
        resumed.train_mini_batch(b2, compute_norm(b2))
        got = dict(resumed.named_weights())
    finally:
        resumed.close()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_lora_on_unknown_projections_is_an_error_naming_the_key(hf_dir, host):
    with pytest.raises(ValueError, match=r"\[train\] lora.target_modules = \['qkv'\].*unknown: \['qkv'\]"):
        megatron_worker(lora_job(hf_dir, target_modules=["qkv"]), host)
