"""The megatron backend's ``StepwiseTraining`` capability (a step driven in parts, as the
Tinker-compatible service drives it) against the torch backend's, on the same tiny Qwen3 weights:
gradients of several calls add up, the caller's Adam hyperparameters and clipping apply to the
step, ``reset_optimizer_state`` gives a fresh Adam, and two models of one process share its
process group until the last one closes."""

from __future__ import annotations

import pytest
import torch

try:
    import megatron.core  # noqa: F401
except ImportError as exc:  # fail, never skip: the backend's tests need the real library
    raise ImportError("megatron-core is not installed: pip install -r requirements-megatron.txt") from exc

from loongsage_plugin_megatron import plugin
from loongsage_plugin_torch.trainer import create_train_worker as create_torch_worker
from megatron_test_support import make_job, make_train_batch, weights_of

from loongsage_core.algorithms import compute_norm
from loongsage_hookspecs import Batch, StepwiseTraining, TrainWorkerContext

HYPERPARAMETERS = {"lr": 3e-3, "beta1": 0.8, "beta2": 0.99, "eps": 1e-3, "weight_decay": 0.05, "grad_clip": 0.05}
"""Not the job's (``make_job``): and with eps at 1e-3 the clipping to 0.05 shows in Adam's update."""


def _megatron(hf_dir, host):
    backends = {s.name: s for s in plugin.loongsage_train_backends()}
    return backends["megatron"].factory(TrainWorkerContext(job=make_job(hf_dir), components=host))


def _torch(hf_dir, host):
    return create_torch_worker(TrainWorkerContext(job=make_job(hf_dir), components=host))


@pytest.fixture
def workers(hf_dir, host):
    meg = _megatron(hf_dir, host)
    yield meg, _torch(hf_dir, host)
    meg.close()


def _weight_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Mean absolute difference of two sets of exported weights (Adam normalises each element, so
    near-zero gradients amplify rounding: compare on average, as the GRPO step test does)."""
    return float(torch.cat([(a[n] - t).abs().flatten() for n, t in b.items()]).mean())


def _parts(ref, seed: int) -> tuple[Batch, Batch, object]:
    """A GRPO batch's two halves and the whole batch's norm (the denominators both parts share)."""
    batch = make_train_batch(ref, seed=seed)
    return batch.select([0, 1]), batch.select([2, 3]), compute_norm(batch)


def _step_in_parts(worker, parts, hyperparameters=None) -> dict[str, float]:
    first, second, norm = parts
    worker.accumulate_gradients(first, norm)
    worker.accumulate_gradients(second, norm)
    return worker.optimizer_step(hyperparameters=hyperparameters)


def test_the_backend_declares_and_implements_stepwise_training(workers):
    meg, _ = workers
    spec = next(s for s in plugin.loongsage_train_backends() if s.name == "megatron")
    assert StepwiseTraining in spec.capabilities and isinstance(meg, StepwiseTraining)


def test_steps_in_parts_with_the_callers_hyperparameters_equal_torch(workers, hf_dir, host):
    """Two ``accumulate_gradients`` calls then ``optimizer_step(hyperparameters)``, then a reset
    and a second step: the weights of the torch backend driven the same way, far from those of
    the same calls under the job's Adam settings (``plain``) or without the reset (``kept``)."""
    meg, ref = workers
    plain, kept = _torch(hf_dir, host), _torch(hf_dir, host)
    start = weights_of(meg)
    parts = _parts(ref, seed=1)
    m_meg = _step_in_parts(meg, parts, HYPERPARAMETERS)
    m_ref = _step_in_parts(ref, parts, HYPERPARAMETERS)
    _step_in_parts(kept, parts, HYPERPARAMETERS)
    _step_in_parts(plain, parts)
    assert m_meg["train/lr"] == m_ref["train/lr"] == HYPERPARAMETERS["lr"]
    assert m_meg["train/grad_norm"] > HYPERPARAMETERS["grad_clip"] and m_meg["train/skipped_step"] == 0.0
    assert m_meg["train/grad_norm"] == pytest.approx(m_ref["train/grad_norm"], rel=1e-4)
    first = weights_of(meg)
    moved = _weight_gap(first, start)
    assert moved > 1e-5
    assert _weight_gap(first, weights_of(ref)) < 1e-3 * moved
    assert _weight_gap(first, weights_of(plain)) > 0.1 * moved

    parts = _parts(ref, seed=2)
    for worker in (meg, ref):
        worker.reset_optimizer_state()
        _step_in_parts(worker, parts, {"lr": 2e-3})
    _step_in_parts(kept, parts, {"lr": 2e-3})
    second = weights_of(meg)
    assert _weight_gap(second, first) > 1e-5
    assert _weight_gap(second, weights_of(ref)) < 1e-3 * moved
    assert _weight_gap(second, weights_of(kept)) > 0.1 * _weight_gap(second, first)


def test_grad_clip_applies_to_its_step_only(workers):
    meg, ref = workers
    job_clip = meg.job.train.grad_clip
    metrics = _step_in_parts(meg, _parts(ref, seed=3), {"grad_clip": 1e-3})
    assert metrics["train/grad_norm"] > 1e-3  # the norm before clipping
    assert {opt.config.clip_grad for opt in meg.optimizer.chained_optimizers} == {job_clip}
    with pytest.raises(ValueError, match="unknown hyperparameters momentum"):
        meg.optimizer_step(hyperparameters={"momentum": 0.9})


def test_two_models_of_one_process_share_its_process_group(hf_dir, host):
    import torch.distributed as dist

    first, second = _megatron(hf_dir, host), _megatron(hf_dir, host)
    batch = make_train_batch(first, seed=5)
    first.close()
    assert dist.is_initialized()  # the second model still uses it
    second.train_mini_batch(batch, compute_norm(batch))
    second.close()
    assert not dist.is_initialized()
