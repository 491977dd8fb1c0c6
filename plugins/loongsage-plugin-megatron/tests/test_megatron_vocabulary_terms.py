"""Full logits in the megatron train backend (CPU): vocabulary-level KL and distillation terms in
the training step, and ``MegatronTrainWorker.score`` under pipeline parallelism.

* The training step with the distill plugin's vocabulary-level terms (``requires = "logits"`` or
  ``"topk"``: ``opd_full_kl`` to the reference beside ``opd_topk_kl`` distillation, and
  ``opd_mix_logits`` with a JSD term) equals the torch backend's step on the same tiny Qwen3:
  loss and term metrics, gradient norm, the updated weights and log-probs.
* TP = 2 (the vocabulary-sharded output layer, its logits gathered with gradient) and PP = 2 (the
  loss on the last stage) take the same step as TP = PP = 1.
* ``score`` under PP = 2 returns on both stages what PP = 1 returns: log-probs, top-k ids and
  log-probs, full logits (float32 and bfloat16), on the output device.

The multi-rank phases run in two spawned processes, each phase with its own process group; rank
0 alone then builds the one-rank references.
"""

from __future__ import annotations

import attrs
import pytest
import torch

try:
    import megatron.core  # noqa: F401
except ImportError as exc:  # fail, never skip: the backend's tests need the real library
    raise ImportError("megatron-core is not installed: pip install -r requirements-megatron.txt") from exc

import megatron_test_support as support
from loongsage_plugin_megatron import plugin
from loongsage_plugin_torch.trainer import create_train_worker as create_torch_worker

from loongsage_core.algorithms import LossPipeline, compute_norm
from loongsage_core.config import JobConfig
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import Batch, TrainWorkerContext

VOCAB = 512  # the tiny Qwen3's vocabulary
TOPK = 5  # the teacher's top-k in the batches
TEACHER_ROWS = (1.0, 1.0, 0.0, 1.0)  # row 2's source has no teacher

# [algorithm] settings of the vocabulary-level terms under test.
CASES = {
    # A full-vocabulary KL to the reference beside a top-k distillation term on teacher rows.
    "full_kl_and_topk": dict(kl="opd_full_kl", kl_coef=0.5, distill_kl="opd_topk_kl", distill_coef=0.7,
                             distill_kl_args={"k": 4}, distill_topk=TOPK),
    # Distillation alone: the PG surrogate mixed with a generalised JSD over the full vocabulary.
    "mix_jsd": dict(distill_kl="opd_mix_logits", distill_coef=0.7,
                    distill_kl_args={"gkd": "jsd", "gkd_args": {"beta": 0.3}}),
}


def vocab_job(path: str, case: str, **backend_args) -> JobConfig:
    """``megatron_test_support.make_job`` with the ``[algorithm]`` terms of ``CASES[case]``."""
    job = support.make_job(path, **backend_args)
    return attrs.evolve(job, algorithm=attrs.evolve(job.algorithm, **CASES[case]))


def with_vocab_targets(batch: Batch, seed: int) -> Batch:
    """``batch`` plus what the teacher pass leaves for vocabulary-level terms: ``ref_*`` and
    ``teacher_*`` log-probs, top-k and full logits of random distributions in the batch layout
    (entry ``t`` describes token ``t``; position 0 and padding hold 0), and ``teacher_mask``
    (rows without a teacher hold zeros in every ``teacher_*`` tensor)."""
    g = torch.Generator().manual_seed(seed)
    ids = batch["input_ids"]
    rows, width = ids.shape
    scored = batch["attention_mask"].bool().clone()
    scored[:, 0] = False
    teacher_rows = torch.tensor(TEACHER_ROWS[:rows])[:, None].expand(rows, width)
    for prefix, keep in (("ref_", scored), ("teacher_", scored & (teacher_rows > 0))):
        logits = torch.where(keep[..., None], 2.0 * torch.randn(rows, width, VOCAB, generator=g), 0.0)
        logp = torch.log_softmax(logits, -1)
        top_logp, top_ids = logp.topk(TOPK, dim=-1)
        batch.tensors[prefix + "logits"] = logits
        batch.tensors[prefix + "logprobs"] = torch.where(keep, logp.gather(-1, ids[..., None])[..., 0], 0.0)
        batch.tensors[prefix + "topk_ids"] = torch.where(keep[..., None], top_ids, 0)
        batch.tensors[prefix + "topk_logprobs"] = torch.where(keep[..., None], top_logp, 0.0)
    batch.tensors["teacher_mask"] = teacher_rows.contiguous()
    return batch


def train_batch(ref, seed: int) -> Batch:
    """A GRPO batch (old log-probs near ``ref``'s) with the vocabulary-level terms' targets."""
    return with_vocab_targets(support.make_train_batch(ref, seed=seed), seed=seed + 10)


@pytest.mark.parametrize("case", sorted(CASES))
def test_vocabulary_terms_step_matches_torch_backend(hf_dir, host, case):
    job = vocab_job(hf_dir, case)
    assert LossPipeline.from_job(job, host).needs_logits  # the step must hand the loss the full logits
    meg = plugin.create_train_worker(TrainWorkerContext(job=job, components=host))
    try:
        ref = create_torch_worker(TrainWorkerContext(job=vocab_job(hf_dir, case), components=host))
        batch = train_batch(ref, seed=1)
        norm = compute_norm(batch)
        m_meg = meg.train_mini_batch(batch, norm)
        m_ref = ref.train_mini_batch(batch, norm)
        assert m_ref["train/distill_loss"] > 1e-3  # the term is in the loss
        if "kl" in CASES[case]:
            assert m_ref["train/kl_loss"] > 1e-3
        assert m_meg["train/grad_norm"] == pytest.approx(m_ref["train/grad_norm"], rel=1e-4)
        shared = [key for key in m_ref if key.startswith("train/") and key in m_meg]
        assert {"train/loss", "train/distill", "train/distill_loss"} <= set(shared)
        for key in shared:
            assert m_meg[key] == pytest.approx(m_ref[key], rel=1e-4, abs=1e-6), key
        # The step moved both models alike: their weights and updated log-probs.
        after, moved = dict(meg.named_weights()), dict(ref.named_weights())
        assert torch.cat([(after[n] - t).abs().flatten() for n, t in moved.items()]).mean() < 1e-5
        scored = batch["loss_mask"] > 0
        got, want = meg.forward(batch)["logprobs"], ref.forward(batch)["logprobs"]
        assert float((want[scored] - batch["old_logprobs"][scored]).abs().max()) > 1e-3  # the step showed
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    finally:
        meg.close()


def score_batch(rows: int = 4, seed: int = 0) -> Batch:
    """Rows for ``score``: right-padded, without a loss mask (every real token is scored)."""
    batch = support.make_batch(rows=rows, seed=seed)
    return Batch(tensors={"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})


def _scores(w) -> dict:
    """``w.score`` on the calls the PP = 2 test compares: everything (float32 logits), top-k and
    bfloat16 logits on three rows (a padded second micro-batch under PP = 2), log-probs only."""
    return {"full": w.score(score_batch(), topk=TOPK, return_logits=True),
            "bf16": w.score(score_batch(rows=3, seed=3), topk=3, return_logits=True, logits_dtype=torch.bfloat16),
            "plain": w.score(score_batch())}


def _step(w, batch: Batch, result: dict, name: str) -> None:
    """One training step of ``w`` on ``batch``, then its log-probs of ``batch``, into ``result``."""
    result[f"{name}_metrics"] = w.train_mini_batch(batch, compute_norm(batch))
    result[f"{name}_forward_after"] = w.forward(batch)
    w.close()


def _two_rank_job(rank: int, out: str, hf_dir: str, batch: Batch) -> dict:
    """PP = 2 (score, then a step with the vocabulary-level terms) and TP = 2 (the step) on both
    ranks; then the one-rank references on rank 0 alone. Returns the rank's results."""
    ports, _listening = support.rendezvous_ports(rank, out, 2)
    host = PluginHost.create([])
    result: dict = {}

    def worker(port: int, world: int = 2, **backend_args):
        return plugin.create_train_worker(TrainWorkerContext(
            job=vocab_job(hf_dir, "full_kl_and_topk", **backend_args), components=host, rank=rank,
            world_size=world, master_port=port))

    w = worker(ports[0], pp=2)
    result["pp_scores"] = _scores(w)
    _step(w, batch, result, "pp")
    _step(worker(ports[1], tp=2), batch, result, "tp")
    if rank == 0:
        w = worker(0, world=1)
        result["one_scores"] = _scores(w)
        _step(w, batch, result, "one")
    return result


@pytest.fixture(scope="module")
def two_ranks(slow_fixture, hf_dir, host, tmp_path_factory):
    """Run :func:`_two_rank_job` on two spawned ranks; returns (rank results, the training batch)."""
    ref = create_torch_worker(TrainWorkerContext(job=vocab_job(hf_dir, "full_kl_and_topk"), components=host))
    batch = train_batch(ref, seed=6)
    out = tmp_path_factory.mktemp("vocabulary_terms_ranks")
    return support.run_ranks(_two_rank_job, 2, out, hf_dir, batch), batch


def test_score_under_pipeline_parallel_2_equals_pp_1(two_ranks):
    (rank0, rank1), _ = two_ranks
    want = rank0["one_scores"]
    assert want["full"]["logits"].shape == (4, 12, VOCAB) and want["bf16"]["logits"].dtype == torch.bfloat16
    # Rank 0 holds the first stage (no logits of its own: it received them), rank 1 the last.
    for rank in (rank0, rank1):
        got = rank["pp_scores"]
        for call in ("full", "bf16", "plain"):
            assert set(got[call]) == set(want[call]), call
            for key, value in want[call].items():
                assert got[call][key].shape == value.shape and got[call][key].dtype == value.dtype, (call, key)
                assert got[call][key].device == torch.device("cpu"), (call, key)
            torch.testing.assert_close(got[call]["logprobs"], want[call]["logprobs"], rtol=0, atol=1e-5)
        for call in ("full", "bf16"):
            assert torch.equal(got[call]["topk_ids"], want[call]["topk_ids"]), call
            torch.testing.assert_close(got[call]["topk_logprobs"], want[call]["topk_logprobs"], rtol=0, atol=1e-5)
        torch.testing.assert_close(got["full"]["logits"], want["full"]["logits"], rtol=0, atol=1e-5)
        # bfloat16 keeps 8 significant bits: within half a unit in the last place.
        torch.testing.assert_close(got["bf16"]["logits"].float(), want["bf16"]["logits"].float(), rtol=2**-8,
                                   atol=1e-5)
    assert torch.equal(rank0["pp_scores"]["full"]["logits"], rank1["pp_scores"]["full"]["logits"])
    real = score_batch()["attention_mask"].bool()
    real[:, 0] = False
    assert bool((rank0["pp_scores"]["full"]["logprobs"][real] < 0).all())  # received, not left zero-filled


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_vocabulary_terms_step_under_tp_2_and_pp_2_equals_one_rank(two_ranks, layout):
    (rank0, rank1), batch = two_ranks
    want = rank0["one_metrics"]
    assert want["train/kl_loss"] > 1e-3 and want["train/distill_loss"] > 1e-3
    for rank in (rank0, rank1):
        got = rank[f"{layout}_metrics"]
        assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-4)
        for key in ("train/loss", "train/pg_loss", "train/kl", "train/kl_loss", "train/distill",
                    "train/distill_loss", "train/entropy", "train/lr"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
        torch.testing.assert_close(rank[f"{layout}_forward_after"]["logprobs"], rank0["one_forward_after"]["logprobs"],
                                   rtol=0, atol=1e-5)
    scored = batch["loss_mask"] > 0
    moved = (rank0["one_forward_after"]["logprobs"] - batch["old_logprobs"])[scored].abs().max()
    assert float(moved) > 1e-3
