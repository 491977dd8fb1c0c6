"""distill_metrics against pure-Python references (masked means over trained tokens)."""

from __future__ import annotations

import math

import pytest
import torch
from loongsage_plugin_distill import distill_metrics

from loongsage_hookspecs import KLInputs


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_full_logit_metrics_match_reference(case, ref):
    x = case.inputs()
    k = 3
    out = distill_metrics(x, input_ids=case.tokens, k=k)
    pos = case.positions()
    kl_ref, inside, overlap, h_t, gap = [], [], [], [], []
    for b, t in pos:
        s, q = case.student(b, t), case.teacher(b, t)
        y = int(case.tokens[b, t])
        kl_ref.append(math.log(s[y]) - math.log(q[y]))
        top_q = set(sorted(range(len(q)), key=lambda i: -q[i])[:k])
        top_s = set(sorted(range(len(s)), key=lambda i: -s[i])[:k])
        inside.append(1.0 if y in top_q else 0.0)
        overlap.append(len(top_q & top_s) / k)
        h_t.append(ref.entropy(q))
        gap.append(ref.entropy(s) - ref.entropy(q))
    assert set(out) == {"train/opd_kl", "train/opd_topk_overlap_ratio", "train/opd_topk_set_overlap",
                        "train/opd_teacher_entropy", "train/opd_entropy_gap"}
    assert out["train/opd_kl"] == pytest.approx(mean(kl_ref), abs=1e-12)
    assert out["train/opd_topk_overlap_ratio"] == pytest.approx(mean(inside))
    assert out["train/opd_topk_set_overlap"] == pytest.approx(mean(overlap))
    assert out["train/opd_teacher_entropy"] == pytest.approx(mean(h_t), abs=1e-12)
    assert out["train/opd_entropy_gap"] == pytest.approx(mean(gap), abs=1e-12)
    assert 0.0 < out["train/opd_topk_overlap_ratio"] < 1.0  # the case has both kinds of token


def test_topk_only_metrics_use_bucket_entropies(case, ref):
    full = case.inputs(topk=4)
    x = KLInputs(logprobs=full.logprobs, ref_logprobs=full.ref_logprobs, response_mask=full.response_mask,
                 logits=full.logits, ref_topk_ids=full.ref_topk_ids, ref_topk_logprobs=full.ref_topk_logprobs)
    out = distill_metrics(x)
    h_t, gap = [], []
    for b, t in case.positions():
        s, q = case.student(b, t), case.teacher(b, t)
        support = sorted(range(len(q)), key=lambda i: -q[i])[:4]
        hq = ref.entropy(ref.topk_buckets(q, support, "tail"))
        h_t.append(hq)
        gap.append(ref.entropy(ref.topk_buckets(s, support, "tail")) - hq)
        assert hq <= ref.entropy(q) + 1e-12  # the bucket entropy is a lower bound
    assert out["train/opd_teacher_entropy"] == pytest.approx(mean(h_t), abs=1e-12)
    assert out["train/opd_entropy_gap"] == pytest.approx(mean(gap), abs=1e-12)
    assert "train/opd_topk_overlap_ratio" not in out  # needs input_ids


def test_per_token_values_are_masked_and_consistent(case):
    x = case.inputs(topk=4)
    means = distill_metrics(x, input_ids=case.tokens)
    tokens = distill_metrics(x, input_ids=case.tokens, per_token=True)
    assert set(tokens) == set(means)
    count = float(case.mask.sum())
    for key, value in tokens.items():
        assert value.shape == case.mask.shape and not value.requires_grad
        assert bool((value[case.mask == 0] == 0).all())
        assert float(value.sum()) / count == pytest.approx(means[key], abs=1e-12)


def test_logprobs_only_and_empty_mask(case):
    x = case.inputs()
    only = KLInputs(logprobs=x.logprobs, ref_logprobs=x.ref_logprobs, response_mask=x.response_mask)
    assert set(distill_metrics(only)) == {"train/opd_kl"}
    empty = KLInputs(logprobs=x.logprobs, ref_logprobs=x.ref_logprobs, response_mask=torch.zeros_like(case.mask))
    assert distill_metrics(empty) == {}
    same = KLInputs(logprobs=x.logprobs, ref_logprobs=x.logprobs.detach(), response_mask=x.response_mask,
                    logits=x.logits, ref_logits=x.logits.detach())
    out = distill_metrics(same, input_ids=case.tokens, k=2)
    assert out["train/opd_kl"] == 0.0 and out["train/opd_entropy_gap"] == pytest.approx(0.0, abs=1e-12)
    assert out["train/opd_topk_set_overlap"] == 1.0
