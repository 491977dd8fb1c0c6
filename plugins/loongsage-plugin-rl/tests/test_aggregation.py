"""Loss aggregations: references, global norms and micro-batch invariance of the gradient."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loongsage_plugin_rl import aggregation as agg
from loongsage_plugin_rl import policy_losses as pl

from loongsage_core.backend_api.loss import compute_norm
from loongsage_hookspecs import AggregationNorm, Batch, PolicyLossInputs

NAMES = ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


def aggregation_norm(masks):
    """The host's global denominators over the loss masks of a mini-batch's micro-batches."""
    masks = [masks] if isinstance(masks, torch.Tensor) else masks
    return compute_norm([Batch(tensors={"loss_mask": m}) for m in masks])


def ref_aggregate(name, loss, mask, max_len=None):
    """Float64 reference over the whole mini-batch, with its own counting of the denominators."""
    rows = [[(loss[i][t], m) for t, m in enumerate(row) if m] for i, row in enumerate(mask)]
    tokens = sum(len(r) for r in rows)
    seqs = sum(1 for r in rows if r)
    longest = max((len(r) for r in rows), default=0)
    if name == "token_mean":
        return sum(v * m for r in rows for v, m in r) / tokens
    if name == "seq_mean_token_sum":
        return sum(sum(v * m for v, m in r) for r in rows) / seqs
    if name == "seq_mean_token_mean":
        return sum(sum(v * m for v, m in r) / len(r) for r in rows if r) / seqs
    length = max_len if max_len is not None else longest
    return sum(v * m for r in rows for v, m in r) / (seqs * length)


def random_minibatch(seed, rows=16, width=12):
    """Per-token loss inputs with ragged lengths, multi-turn holes and two empty rows."""
    rng = random.Random(seed)
    mask = []
    for i in range(rows):
        if i in (3, 11):
            mask.append([0] * width)
            continue
        start, length = rng.randint(0, 4), rng.randint(1, width - 4)
        row = [1 if start <= t < start + length else 0 for t in range(width)]
        if length > 3:
            row[start + 1] = 0  # a tool-output hole
        mask.append(row)
    logp = torch.tensor([[rng.uniform(-3, -0.1) for _ in range(width)] for _ in range(rows)])
    old = logp + torch.tensor([[rng.uniform(-0.4, 0.4) for _ in range(width)] for _ in range(rows)])
    advs = torch.tensor([[rng.choice([-1.0, -0.3, 0.5, 2.0])] * width for _ in range(rows)])
    return torch.tensor(mask), logp, old, advs


def trim(mask, *tensors):
    """Cut a micro-batch to its own padded width (the longest last trained token), as a trainer that
    packs each micro-batch separately would."""
    cols = mask.any(dim=0).nonzero()
    width = int(cols.max()) + 1 if cols.numel() else 1
    return (mask[:, :width],) + tuple(t[:, :width] for t in tensors)


def minibatch_loss_and_grad(name, mask, logp, old, advs, n_micro, **kwargs):
    """Sum over micro-batches of the aggregated ppo_clip loss with the global norm, and its gradient."""
    param = logp.clone().requires_grad_(True)
    chunks = [list(range(i, len(mask), n_micro)) for i in range(n_micro)]  # interleaved rows
    parts = [trim(mask[idx], param[idx], old[idx], advs[idx]) for idx in chunks]
    norm = aggregation_norm([p[0] for p in parts])
    total = 0.0
    for m, lp, o, a in parts:
        out = pl.ppo_clip(PolicyLossInputs(logprobs=lp, old_logprobs=o, advantages=a, response_mask=m))
        total = total + getattr(agg, name)(out.loss, m, norm, **kwargs)
    (grad,) = torch.autograd.grad(total, param)
    return total.detach(), grad


@pytest.mark.parametrize("name", NAMES)
def test_micro_batch_split_does_not_change_loss_or_gradient(name):
    mask, logp, old, advs = random_minibatch(0)
    loss1, grad1 = minibatch_loss_and_grad(name, mask, logp, old, advs, 1)
    # the loss of the unsplit mini-batch equals the float64 reference
    per_token = pl.ppo_clip(PolicyLossInputs(logprobs=logp.double(), old_logprobs=old.double(),
                                             advantages=advs.double(), response_mask=mask)).loss.tolist()
    assert loss1.item() == pytest.approx(ref_aggregate(name, per_token, mask.tolist()), rel=1e-5)
    assert grad1.abs().sum() > 0
    for n_micro in (2, 8):
        loss_n, grad_n = minibatch_loss_and_grad(name, mask, logp, old, advs, n_micro)
        torch.testing.assert_close(loss_n, loss1, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(grad_n, grad1, atol=1e-7, rtol=1e-5)


def test_micro_batch_local_denominators_would_differ():
    """The invariance test above is sensitive: dividing by each micro-batch's own token count
    (the classic length bias) gives a different mini-batch loss."""
    mask, logp, old, advs = random_minibatch(0)
    global_loss, _ = minibatch_loss_and_grad("token_mean", mask, logp, old, advs, 8)
    local = 0.0
    for i in range(8):
        idx = list(range(i, 16, 8))
        m = mask[idx]
        out = pl.ppo_clip(PolicyLossInputs(logprobs=logp[idx], old_logprobs=old[idx], advantages=advs[idx],
                                           response_mask=m))
        local += agg.token_mean(out.loss, m, aggregation_norm(m)).item() / 8
    assert abs(local - global_loss.item()) > 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_sequence_order_does_not_change_the_loss(name):
    mask, logp, old, advs = random_minibatch(1)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    base, base_grad = minibatch_loss_and_grad(name, mask, logp, old, advs, 2)
    shuffled, grad = minibatch_loss_and_grad(name, mask[perm], logp[perm], old[perm], advs[perm], 2)
    torch.testing.assert_close(shuffled, base, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, base_grad[perm], atol=1e-7, rtol=1e-5)


def test_the_host_norm_counts_weighted_masks_once_per_token_over_micro_batches():
    m1 = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0]])
    m2 = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0]])
    norm = aggregation_norm([m1, m2])
    assert norm == AggregationNorm(num_tokens=10.0, num_sequences=4.0, max_response_length=5.0)
    assert aggregation_norm(m1) == AggregationNorm(num_tokens=2.0, num_sequences=1.0, max_response_length=2.0)
    assert aggregation_norm(m1 * 0.5) == aggregation_norm(m1)  # a weighted mask counts tokens, not weights
    with pytest.raises(ValueError, match="compute_norm: 'loss_mask' must be 2-D"):
        aggregation_norm([m1, torch.ones(3)])


def test_seq_mean_token_sum_norm_uses_max_len_argument():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    norm = aggregation_norm(mask)
    assert agg.seq_mean_token_sum_norm(loss, mask, norm).item() == pytest.approx(10.0 / (2 * 3))
    assert agg.seq_mean_token_sum_norm(loss, mask, norm, max_len=100).item() == pytest.approx(10.0 / 200)
    with pytest.raises(ValueError, match="seq_mean_token_sum_norm: argument 'max_len' must be > 0.0"):
        agg.seq_mean_token_sum_norm(loss, mask, norm, max_len=0)


@pytest.mark.parametrize("name", NAMES)
def test_weighted_mask_and_poison_under_mask(name):
    loss = [[0.5, -1.0, 2.0, 3.0], [1.5, 0.25, 0.0, 0.0]]
    mask = [[1, 1, 0, 1], [0, 1, 1, 0]]
    base = getattr(agg, name)(torch.tensor(loss), torch.tensor(mask), aggregation_norm(torch.tensor(mask)))
    assert base.item() == pytest.approx(ref_aggregate(name, loss, mask), rel=1e-6)
    poisoned = torch.tensor([[0.5, -1.0, float("nan"), 3.0], [float("inf"), 0.25, 0.0, float("-inf")]])
    again = getattr(agg, name)(poisoned, torch.tensor(mask), aggregation_norm(torch.tensor(mask)))
    assert torch.equal(again, base)
    weights = [[0.5, 2.0, 0.0, 1.0], [0.0, 1.0, 3.0, 0.0]]  # a mask carrying weights multiplies the loss
    weighted = getattr(agg, name)(torch.tensor(loss), torch.tensor(weights), aggregation_norm(torch.tensor(weights)))
    assert weighted.item() == pytest.approx(ref_aggregate(name, loss, weights), rel=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_empty_and_inconsistent_norms(name):
    fn = getattr(agg, name)
    zero_mask = torch.zeros(2, 3)
    loss = torch.ones(2, 3, requires_grad=True)
    out = fn(loss, zero_mask, aggregation_norm(zero_mask))
    assert out.item() == 0.0 and out.requires_grad
    with pytest.raises(ValueError, match=f"{name}: norm.* is 0 but the mask has trained tokens"):
        fn(loss, torch.ones(2, 3), AggregationNorm(0.0, 0.0, 0.0))
    with pytest.raises(TypeError, match=f"{name}: norm must be an AggregationNorm"):
        fn(loss, torch.ones(2, 3), {"num_tokens": 6})
    with pytest.raises(ValueError, match=f"{name}: mask has shape \\(2, 2\\)"):
        fn(loss, torch.ones(2, 2), AggregationNorm(6.0, 2.0, 3.0))
    with pytest.raises(ValueError, match=f"{name}: norm.num_tokens must be a finite number"):
        fn(loss, torch.ones(2, 3), AggregationNorm(float("nan"), 2.0, 3.0))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.tuples(st.floats(-10, 10), st.booleans()), min_size=3, max_size=3), min_size=1, max_size=8),
       st.sampled_from(NAMES), st.integers(1, 4))
def test_any_split_equals_whole(rows, name, n_micro):
    loss = torch.tensor([[v for v, _ in row] for row in rows], dtype=torch.float64)
    mask = torch.tensor([[int(m) for _, m in row] for row in rows])
    fn = getattr(agg, name)
    chunks = [list(range(i, len(rows), n_micro)) for i in range(n_micro) if i < len(rows)]
    norm = aggregation_norm([mask[c] for c in chunks])
    whole = fn(loss, mask, aggregation_norm(mask))
    split = sum(fn(loss[c], mask[c], norm) for c in chunks)
    assert split.item() == pytest.approx(whole.item(), rel=1e-9, abs=1e-12)
