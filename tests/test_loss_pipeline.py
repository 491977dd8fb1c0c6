"""Tests of the host-side loss pipeline with small hand-written components."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from loongsage_core.algorithms import (
    CORRECTION_MASK_KEY,
    CORRECTION_WEIGHTS_KEY,
    LossPipeline,
    LossPipelineError,
    MetricAccumulator,
    StepAlgorithm,
    compute_norm,
    train_inference_gap,
)
from loongsage_core.config import AlgorithmConfig, JobConfig
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import (
    AdvantageOutput,
    AdvantageSpec,
    AggregationNorm,
    AggregationSpec,
    Batch,
    CorrectionOutput,
    CorrectionSpec,
    KLSpec,
    PolicyLossOutput,
    PolicyLossSpec,
)

# ---------------------------------------------------------------------------------------------
# A tiny registry of hand-written components
# ---------------------------------------------------------------------------------------------

CALLS: list[str] = []


def pg_loss(x, **_):
    ratio = torch.exp(x.logprobs - x.old_logprobs)
    return PolicyLossOutput(loss=-x.advantages * ratio, metrics={"ratio": ratio.detach()})


def clipped_loss(x, eps=0.2):
    ratio = torch.exp(x.logprobs - x.old_logprobs)
    clipped = torch.clamp(ratio, 1 - eps, 1 + eps)
    loss = torch.maximum(-x.advantages * ratio, -x.advantages * clipped)
    clip = ((-x.advantages * clipped) > (-x.advantages * ratio)).float()
    return PolicyLossOutput(loss=loss, metrics={"clip_ratio": clip})


def token_mean(loss, mask, norm):
    return (loss * mask).sum() / norm.num_tokens


def seq_mean_token_mean(loss, mask, norm):
    per_seq = (loss * mask).sum(1) / mask.sum(1).clamp_min(1)
    return per_seq.sum() / norm.num_sequences


def k1(x):
    return x.logprobs - x.ref_logprobs


def capped_is(x, cap=2.0):
    CALLS.append("capped_is")
    w = torch.exp(x.old_logprobs - x.rollout_logprobs).clamp(max=cap)
    return CorrectionOutput(weights=w, metrics={"is_weight": w, "is_cap": cap})


def drop_far(x, threshold=0.5):
    CALLS.append("drop_far")
    far = (x.logprobs - x.old_logprobs).abs() > threshold
    return CorrectionOutput(mask=(~far).float(), metrics={"dropped": far.float()})


def record_mask(x):
    CALLS.append(f"record_mask:{int(x.response_mask.sum())}")
    return CorrectionOutput()


def halve_first_row(x):
    CALLS.append("halve_first_row")
    m = torch.ones_like(x.response_mask)
    m[0] = 0
    return CorrectionOutput(mask=m)


def Registry(*specs) -> PluginHost:  # noqa: N802 - reads like the registry the pipeline receives
    """The real host, no plugin enabled, with this file's reference components registered."""
    host = PluginHost.create(enable=[], entry_points=False)
    host.register_specs(*specs)
    return host


REGISTRY = Registry(
    PolicyLossSpec(name="pg", fn=pg_loss),
    PolicyLossSpec(name="clipped", fn=clipped_loss),
    AggregationSpec(name="token_mean", fn=token_mean),
    AggregationSpec(name="seq_mean_token_mean", fn=seq_mean_token_mean),
    KLSpec(name="k1", fn=k1),
    CorrectionSpec(name="capped_is", fn=capped_is, stage="pre_advantage"),
    CorrectionSpec(name="drop_far", fn=drop_far, stage="post_forward"),
    CorrectionSpec(name="record_mask", fn=record_mask, stage="pre_advantage"),
    CorrectionSpec(name="halve_first_row", fn=halve_first_row, stage="pre_advantage"),
    AdvantageSpec(name="grpo", fn=lambda x: AdvantageOutput(advantages=x.rewards[:, None] * x.response_mask)),
)


def make_job(**algorithm) -> JobConfig:
    algorithm.setdefault("policy_loss", "pg")
    algorithm.setdefault("loss_agg", "token_mean")
    return JobConfig(algorithm=AlgorithmConfig(**algorithm))


def make_batch(rows: int = 6, width: int = 12, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=g)
    prompt = torch.randint(1, 4, (rows,), generator=g)
    t = torch.arange(width)
    attention = (t[None, :] < lengths[:, None]).long()
    loss_mask = ((t[None, :] >= prompt[:, None]) & (t[None, :] < lengths[:, None])).long()
    rollout = -torch.rand(rows, width, generator=g) * 2 * loss_mask
    old = rollout + 0.3 * torch.randn(rows, width, generator=g) * loss_mask
    ref = rollout + 0.2 * torch.randn(rows, width, generator=g) * loss_mask
    adv = torch.randn(rows, 1, generator=g).expand(rows, width) * loss_mask
    return Batch(tensors={
        "input_ids": torch.randint(0, 50, (rows, width), generator=g) * attention,
        "attention_mask": attention, "loss_mask": loss_mask, "rollout_logprobs": rollout,
        "old_logprobs": old, "ref_logprobs": ref, "advantages": adv.contiguous(),
    }, meta={"sample_id": [f"s{i}" for i in range(rows)]})


def current(batch: Batch, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lp = (batch["old_logprobs"] + 0.4 * torch.randn(batch["old_logprobs"].shape, generator=g)) * batch["loss_mask"]
    ent = torch.rand(lp.shape, generator=g) * 3
    return lp.clone().requires_grad_(True), ent.clone().requires_grad_(True)


# ---------------------------------------------------------------------------------------------


def test_loss_matches_manual_formula_and_gradient():
    job = make_job(kl="k1", kl_coef=0.1, entropy_coef=0.01)
    pipe = LossPipeline.from_job(job, REGISTRY)
    batch = make_batch()
    lp, ent = current(batch)
    norm = compute_norm(batch)
    loss, metrics = pipe.loss(batch, lp, ent, norm)

    m = batch["loss_mask"].double()
    lpd, entd = lp.detach().double().requires_grad_(True), ent.detach().double().requires_grad_(True)
    ratio = torch.exp(lpd - batch["old_logprobs"].double())
    pg = (-batch["advantages"].double() * ratio * m).sum() / m.sum()
    kl = ((lpd - batch["ref_logprobs"].double()) * m).sum() / m.sum()
    entropy = (entd * m).sum() / m.sum()
    expected = pg + 0.1 * kl - 0.01 * entropy
    expected.backward()
    loss.backward()

    assert norm.num_tokens == float(m.sum())
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(lp.grad.double(), lpd.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ent.grad.double(), entd.grad, rtol=1e-5, atol=1e-7)
    assert metrics["pg_loss"].item() == pytest.approx(pg.item(), rel=1e-5, abs=1e-6)
    assert metrics["kl_loss"].item() == pytest.approx(kl.item(), rel=1e-5, abs=1e-6)
    assert metrics["ratio"].shape == lp.shape and metrics["pg_loss"].dim() == 0


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("micro", [1, 2, 4])
def test_split_invariance_of_loss_gradient_and_metrics(agg, micro):
    job = make_job(policy_loss="clipped", policy_loss_args={"eps": 0.1}, loss_agg=agg, kl="k1", kl_coef=0.05,
                   entropy_coef=0.02, corrections=["capped_is", "drop_far"],
                   correction_args={"capped_is": {"cap": 1.5}, "drop_far": {"threshold": 0.6}})
    pipe = LossPipeline.from_job(job, REGISTRY)
    batch = make_batch(rows=8)
    StepAlgorithm.from_job(job, REGISTRY).correct(batch)
    lp, ent = current(batch)
    norm = compute_norm(batch)

    whole_loss, whole_metrics = pipe.loss(batch, lp, ent, norm)
    whole_loss.backward()
    whole_grad = lp.grad.clone()
    whole = MetricAccumulator()
    whole.add(whole_metrics, batch["loss_mask"])

    lp.grad = None
    acc = MetricAccumulator()
    total = 0.0
    micro_batches = list(batch.chunks(micro))
    assert compute_norm(micro_batches) == norm
    for start, mb in zip(range(0, len(batch), micro), micro_batches):
        rows = slice(start, start + len(mb))
        loss, metrics = pipe.loss(mb, lp[rows], ent[rows], norm)
        loss.backward()
        total += loss.item()
        acc.add(metrics, mb["loss_mask"])
    assert total == pytest.approx(whole_loss.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(lp.grad, whole_grad, rtol=1e-5, atol=1e-8)
    split, full = acc.result(), whole.result()
    assert split.keys() == full.keys()
    assert {"train/loss", "train/pg_loss", "train/clip_ratio", "train/kl", "train/entropy",
            "train/dropped"} <= split.keys()
    assert "train/is_approx_k3_kl" not in split  # the step's gap, computed once by StepAlgorithm
    for key in full:
        assert split[key] == pytest.approx(full[key], rel=1e-6, abs=1e-9), key


def test_metric_means_are_masked_token_means():
    job = make_job()
    pipe = LossPipeline.from_job(job, REGISTRY)
    batch = make_batch()
    lp, ent = current(batch)
    acc = MetricAccumulator()
    for mb in batch.chunks(4):
        rows = slice(0, len(mb)) if mb.meta["sample_id"][0] == "s0" else slice(4, 6)
        _, metrics = pipe.loss(mb, lp[rows], ent[rows], compute_norm(batch))
        acc.add(metrics, mb["loss_mask"])
    m = batch["loss_mask"].bool()
    expected_entropy = ent.detach()[m].double().mean().item()
    r = (batch["old_logprobs"] - batch["rollout_logprobs"]).double()[m]
    assert acc.result()["train/entropy"] == pytest.approx(expected_entropy, rel=1e-9)
    assert train_inference_gap(batch)["train/is_approx_k3_kl"] == pytest.approx((torch.exp(r) - r - 1).mean().item(),
                                                                                rel=1e-6)


def test_pre_advantage_corrections_run_in_job_order_with_args_and_reduce_the_loss():
    CALLS.clear()
    job = make_job(corrections=["halve_first_row", "record_mask", "capped_is"],
                   correction_args={"capped_is": {"cap": 1.2}})
    pipe = LossPipeline.from_job(job, REGISTRY)
    batch = make_batch()
    metrics = StepAlgorithm.from_job(job, REGISTRY).correct(batch)
    first_row_tokens = int(batch["loss_mask"][0].sum())
    assert CALLS == ["halve_first_row", f"record_mask:{int(batch['loss_mask'].sum()) - first_row_tokens}",
                     "capped_is"]
    w = batch[CORRECTION_WEIGHTS_KEY]
    assert float(w.max()) <= 1.2 + 1e-6
    assert batch[CORRECTION_MASK_KEY][0].sum() == 0 and batch[CORRECTION_MASK_KEY][1:].min() == 1
    assert metrics["train/is_cap"] == 1.2
    m = batch["loss_mask"].bool()
    assert metrics["train/is_weight"] == pytest.approx(w[m].mean().item(), rel=1e-6)

    lp, ent = current(batch)
    norm = compute_norm(batch)
    loss, _ = pipe.loss(batch, lp, ent, norm)
    ratio = torch.exp(lp.detach() - batch["old_logprobs"])
    keep = batch["loss_mask"].float() * batch[CORRECTION_MASK_KEY]
    expected = (-batch["advantages"] * ratio * w * keep).sum() / norm.num_tokens
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_post_forward_correction_masks_tokens_far_from_old_policy():
    job = make_job(corrections=["drop_far"], correction_args={"drop_far": {"threshold": 0.3}})
    pipe = LossPipeline.from_job(job, REGISTRY)
    batch = make_batch()
    lp, ent = current(batch)
    loss, metrics = pipe.loss(batch, lp, ent, compute_norm(batch))
    loss.backward()
    far = (lp.detach() - batch["old_logprobs"]).abs() > 0.3
    assert far.any() and (~far & batch["loss_mask"].bool()).any()
    assert torch.all(lp.grad[far] == 0)
    assert torch.all(lp.grad[~far & batch["loss_mask"].bool()] != 0)
    assert torch.equal(metrics["dropped"], far.float())


def test_missing_step_tensors_and_missing_tensors_are_clear_errors():
    pipe = LossPipeline.from_job(make_job(corrections=["capped_is"]), REGISTRY)
    batch = make_batch()
    lp, ent = current(batch)
    with pytest.raises(LossPipelineError, match="StepAlgorithm.prepare"):
        pipe.loss(batch, lp, ent, compute_norm(batch))

    pipe = LossPipeline.from_job(make_job(kl="k1", kl_coef=0.1), REGISTRY)
    del batch.tensors["ref_logprobs"]
    with pytest.raises(LossPipelineError, match="ref_logprobs"):
        pipe.loss(batch, lp, ent, compute_norm(batch))
    del batch.tensors["advantages"]
    with pytest.raises(LossPipelineError, match="advantages"):
        pipe.loss(batch, lp, ent, compute_norm(batch))
    with pytest.raises(LossPipelineError, match="shape"):
        pipe.loss(make_batch(), lp[:, :5], ent, compute_norm(batch))


def test_kl_in_reward_keeps_kl_out_of_the_loss():
    batch = make_batch()
    lp, ent = current(batch)
    norm = compute_norm(batch)
    base, _ = LossPipeline.from_job(make_job(), REGISTRY).loss(batch, lp, ent, norm)
    in_reward, metrics = LossPipeline.from_job(make_job(kl="k1", kl_coef=1.0, kl_in_reward=True), REGISTRY).loss(
        batch, lp, ent, norm)
    with_kl, _ = LossPipeline.from_job(make_job(kl="k1", kl_coef=1.0), REGISTRY).loss(batch, lp, ent, norm)
    assert in_reward.item() == base.item() and "kl" not in metrics
    assert with_kl.item() != base.item()


def test_bad_policy_loss_shape_is_rejected():
    reg = Registry(PolicyLossSpec(name="bad", fn=lambda x: PolicyLossOutput(loss=x.logprobs.sum())),
                   AggregationSpec(name="token_mean", fn=token_mean))
    batch = make_batch()
    lp, ent = current(batch)
    with pytest.raises(LossPipelineError, match="per token"):
        LossPipeline.from_job(make_job(policy_loss="bad"), reg).loss(batch, lp, ent, compute_norm(batch))


def test_compute_norm_counts_and_floors():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    norm = compute_norm(Batch(tensors={"loss_mask": mask}))
    assert norm == AggregationNorm(num_tokens=6.0, num_sequences=2.0, max_response_length=4.0)
    empty = compute_norm(Batch(tensors={"loss_mask": torch.zeros(2, 3)}))
    assert empty == AggregationNorm(num_tokens=1.0, num_sequences=1.0, max_response_length=1.0)


def test_metric_accumulator_rejects_mixed_kinds():
    acc = MetricAccumulator()
    acc.add({"x": torch.ones(2, 2)}, torch.ones(2, 2))
    with pytest.raises(ValueError, match="both"):
        acc.add({"x": torch.tensor(1.0)})


def test_import_does_not_pull_torch():
    code = "import sys, loongsage_core.algorithms; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
