"""Policy losses against float64 per-token references, gradient checks and property tests."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loongsage_plugin_rl import policy_losses as pl

from loongsage_hookspecs import PolicyLossInputs

MASK = [
    [0, 1, 1, 1, 0, 0],
    [1, 1, 0, 1, 1, 0],
    [0, 0, 0, 0, 0, 0],
    [0, 1, 1, 1, 1, 1],
]


def random_case(seed: int, spread: float = 0.5):
    rng = random.Random(seed)
    shape = (len(MASK), len(MASK[0]))
    logp = [[rng.uniform(-3, -0.1) for _ in range(shape[1])] for _ in range(shape[0])]
    old = [[logp[i][t] + rng.uniform(-spread, spread) for t in range(shape[1])] for i in range(shape[0])]
    advs = [[rng.choice([-1.5, -0.4, 0.3, 1.2]) for _ in range(shape[1])] for _ in range(shape[0])]
    return logp, old, advs


def run(fn, logp, old, advs, mask=MASK, **kwargs):
    """Loss, metrics and d(sum loss)/d logp, all in float64."""
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    out = fn(PolicyLossInputs(logprobs=lp, old_logprobs=torch.tensor(old, dtype=torch.float64),
                              advantages=torch.tensor(advs, dtype=torch.float64),
                              response_mask=torch.tensor(mask)), **kwargs)
    (grad,) = torch.autograd.grad(out.loss.sum(), lp)
    return out.loss.detach(), out.metrics, grad


def clip(x, lo, hi):
    return min(max(x, lo), hi)


def ref_ppo(logp, old, advs, mask, cl, ch, dual):
    """Per-token loss, d loss / d logp, clip indicator and dual-clip indicator."""
    loss, grad, clipped, dualed = ([[0.0] * len(r) for r in mask] for _ in range(4))
    for i, row in enumerate(mask):
        for t, m in enumerate(row):
            if not m:
                continue
            a = advs[i][t]
            r = math.exp(clip(logp[i][t] - old[i][t], -20, 20))
            un, cp = -a * r, -a * clip(r, 1 - cl, 1 + ch)
            value = max(un, cp)
            g = -a * r if un >= cp else 0.0
            clipped[i][t] = float(cp > un)
            if dual is not None and a < 0 and value > -a * dual:
                value, g = -a * dual, 0.0
                dualed[i][t] = 1.0
            loss[i][t], grad[i][t] = value, g
    return loss, grad, clipped, dualed


def t64(x):
    return torch.tensor(x, dtype=torch.float64)


@pytest.mark.parametrize(("cl", "ch", "dual"), [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)])
def test_ppo_clip_matches_reference(cl, ch, dual):
    logp, old, advs = random_case(0, spread=0.6)
    # extreme ratio on a negative advantage token: only the dual clip bounds it
    logp[0][1], old[0][1], advs[0][1] = -0.1, -9.0, -1.5
    loss, metrics, grad = run(pl.ppo_clip, logp, old, advs, clip_low=cl, clip_high=ch, dual_clip=dual)
    exp_loss, exp_grad, exp_clip, exp_dual = ref_ppo(logp, old, advs, MASK, cl, ch, dual)
    torch.testing.assert_close(loss, t64(exp_loss))
    torch.testing.assert_close(grad, t64(exp_grad))
    torch.testing.assert_close(metrics["clip_ratio"], t64(exp_clip))
    torch.testing.assert_close(metrics["dual_clip_ratio"], t64(exp_dual))
    assert sum(map(sum, exp_clip)) > 0
    if dual is not None:
        assert exp_dual[0][1] == 1.0
    ratio = [[math.exp(logp[i][t] - old[i][t]) if m else 0.0 for t, m in enumerate(r)] for i, r in enumerate(MASK)]
    k3 = [[(x - math.log(x) - 1) if x else 0.0 for x in row] for row in ratio]
    torch.testing.assert_close(metrics["ratio"], t64(ratio))
    torch.testing.assert_close(metrics["approx_kl"], t64(k3))
    assert all(not m.requires_grad for m in metrics.values())


def test_gspo_matches_reference():
    logp, old, advs = random_case(1, spread=0.002)
    for i in range(len(MASK)):  # GSPO uses one advantage per sequence
        advs[i] = [advs[i][0]] * len(advs[i])
    cl, ch = 3e-4, 4e-4
    loss, metrics, grad = run(pl.gspo, logp, old, advs)
    for i, row in enumerate(MASK):
        pos = [t for t, m in enumerate(row) if m]
        s = math.exp(sum(logp[i][t] - old[i][t] for t in pos) / len(pos)) if pos else 1.0
        for t, m in enumerate(row):
            if not m:
                assert loss[i, t] == 0 and grad[i, t] == 0
                continue
            a = advs[i][t]
            un, cp = -a * s, -a * clip(s, 1 - cl, 1 + ch)
            assert loss[i, t].item() == pytest.approx(max(un, cp), rel=1e-12, abs=1e-12)
            # token form: the gradient is s_i * d logp_t on the unclipped branch, 0 when clipped
            assert grad[i, t].item() == pytest.approx(-a * s if un >= cp else 0.0, rel=1e-12, abs=1e-12)
            assert metrics["ratio"][i, t].item() == pytest.approx(s, rel=1e-12)
            assert metrics["clip_ratio"][i, t].item() == float(cp > un)
    assert metrics["clip_ratio"].sum() > 0  # the case exercises both branches
    assert (metrics["clip_ratio"][torch.tensor(MASK) == 1] == 0).any()


def test_cispo_matches_reference():
    logp, old, advs = random_case(2, spread=0.8)
    cl, ch = 0.5, 0.28
    loss, metrics, grad = run(pl.cispo, logp, old, advs, clip_low=cl, clip_high=ch)
    for i, row in enumerate(MASK):
        for t, m in enumerate(row):
            if not m:
                assert loss[i, t] == 0 and grad[i, t] == 0
                continue
            r = math.exp(logp[i][t] - old[i][t])
            w = clip(r, 1 - cl, 1 + ch)
            assert loss[i, t].item() == pytest.approx(-w * advs[i][t] * logp[i][t], rel=1e-12)
            assert grad[i, t].item() == pytest.approx(-w * advs[i][t], rel=1e-12)  # every token keeps a gradient
            assert metrics["clip_ratio"][i, t].item() == float(r < 1 - cl or r > 1 + ch)
    assert metrics["clip_ratio"].sum() > 0


def test_reinforce_matches_reference():
    logp, old, advs = random_case(3)
    loss, _, grad = run(pl.reinforce, logp, old, advs)
    expected = [[-advs[i][t] * logp[i][t] if m else 0.0 for t, m in enumerate(r)] for i, r in enumerate(MASK)]
    torch.testing.assert_close(loss, t64(expected))
    torch.testing.assert_close(grad, t64([[-advs[i][t] if m else 0.0 for t, m in enumerate(r)]
                                          for i, r in enumerate(MASK)]))


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo", "reinforce"])
def test_extreme_ratios_and_poison_under_mask_stay_finite(name):
    logp, old, advs = random_case(4)
    logp[0][1], old[0][1] = -0.01, -800.0  # log-ratio 800: exp would overflow
    logp[1][0], old[1][0] = -900.0, -0.01  # log-ratio -900
    poisoned_logp = [row[:] for row in logp]
    poisoned_old = [row[:] for row in old]
    for i, row in enumerate(MASK):
        for t, m in enumerate(row):
            if not m:
                poisoned_logp[i][t] = float("-inf") if t % 2 else float("nan")
                poisoned_old[i][t] = float("-inf")
    loss, metrics, grad = run(getattr(pl, name), poisoned_logp, poisoned_old, advs)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert all(torch.isfinite(m).all() for m in metrics.values())
    off = torch.tensor(MASK) == 0
    assert (loss[off] == 0).all() and (grad[off] == 0).all()


def test_float32_inputs_and_metric_dtypes():
    logp, old, advs = random_case(5)
    out = pl.ppo_clip(PolicyLossInputs(logprobs=torch.tensor(logp),
                                       old_logprobs=torch.tensor(old, dtype=torch.float64),
                                       advantages=torch.tensor(advs),
                                       response_mask=torch.tensor(MASK, dtype=torch.bool)))
    assert out.loss.dtype == torch.float32
    assert set(out.metrics) == {"clip_ratio", "dual_clip_ratio", "ratio", "approx_kl"}
    assert all(m.shape == out.loss.shape for m in out.metrics.values())


def test_argument_and_input_errors():
    logp, old, advs = random_case(6)
    inputs = PolicyLossInputs(logprobs=torch.tensor(logp), old_logprobs=torch.tensor(old),
                              advantages=torch.tensor(advs), response_mask=torch.tensor(MASK))
    with pytest.raises(ValueError, match="ppo_clip: argument 'dual_clip' must be > 1.0"):
        pl.ppo_clip(inputs, dual_clip=1.0)
    with pytest.raises(ValueError, match="ppo_clip: argument 'clip_low' must be <= 1.0"):
        pl.ppo_clip(inputs, clip_low=1.5)
    with pytest.raises(ValueError, match="gspo: argument 'clip_high' must be >= 0.0"):
        pl.gspo(inputs, clip_high=-1e-4)
    with pytest.raises(TypeError, match="cispo: argument 'clip_high' must be a number"):
        pl.cispo(inputs, clip_high="0.2")
    with pytest.raises(TypeError, match="unexpected keyword argument 'clip'"):
        pl.ppo_clip(inputs, clip=0.2)
    with pytest.raises(TypeError, match="reinforce: expected PolicyLossInputs"):
        pl.reinforce({"logprobs": logp})
    bad = PolicyLossInputs(logprobs=torch.tensor(logp), old_logprobs=torch.tensor(old)[:, :5],
                           advantages=torch.tensor(advs), response_mask=torch.tensor(MASK))
    with pytest.raises(ValueError, match="ppo_clip: old_logprobs has shape \\(4, 5\\)"):
        pl.ppo_clip(bad)


# ------------------------------------------------------------------------------------------------
# Property tests
# ------------------------------------------------------------------------------------------------

finite = st.floats(-30.0, 30.0, allow_nan=False, allow_infinity=False)
token = st.tuples(st.floats(-8.0, 0.0), finite, st.floats(-5.0, 5.0), st.booleans())
tokens = st.lists(token, min_size=1, max_size=12)
poison = st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e30, -1e30, 0.0])


def as_rows(tok):
    """One row of tokens: (logp, old, adv, mask) lists, with old = logp + delta."""
    logp = [[x[0] for x in tok]]
    old = [[x[0] + x[1] for x in tok]]
    advs = [[x[2] for x in tok]]
    mask = [[int(x[3]) for x in tok]]
    return logp, old, advs, mask


@settings(max_examples=60, deadline=None)
@given(tokens, st.floats(0.0, 0.9), st.floats(0.0, 3.0), st.one_of(st.none(), st.floats(1.01, 10.0)))
def test_ppo_clip_bounds(tok, cl, ch, dual):
    logp, old, advs, mask = as_rows(tok)
    loss, metrics, grad = run(pl.ppo_clip, logp, old, advs, mask, clip_low=cl, clip_high=ch, dual_clip=dual)
    for t in range(len(tok)):
        a, lv, g = advs[0][t], loss[0, t].item(), grad[0, t].item()
        if not mask[0][t]:
            assert lv == 0 and g == 0
            continue
        tol = 1e-9 * (1 + abs(a))
        if a > 0:  # the objective can gain at most a * (1 + clip_high) per token
            assert -lv <= a * (1 + ch) + tol
            assert abs(g) <= a * (1 + ch) + tol
        elif a < 0:
            assert lv >= -a * (1 - cl) - tol  # ... and a negative token costs at least |a| (1 - clip_low)
            if dual is not None:
                assert lv <= -a * dual + tol and abs(g) <= -a * max(dual, 1 + ch) + tol
        assert 0.0 <= metrics["clip_ratio"][0, t].item() <= 1.0


@settings(max_examples=40, deadline=None)
@given(tokens, st.floats(0.0, 1.0), st.floats(0.0, 2.0))
def test_cispo_weight_bounds(tok, cl, ch):
    logp, old, advs, mask = as_rows(tok)
    _, _, grad = run(pl.cispo, logp, old, advs, mask, clip_low=cl, clip_high=ch)
    for t in range(len(tok)):
        a = advs[0][t]
        if mask[0][t] and abs(a) > 1e-6:
            weight = grad[0, t].item() / -a
            assert 1 - cl - 1e-9 <= weight <= 1 + ch + 1e-9


@settings(max_examples=40, deadline=None)
@given(tokens)
def test_gspo_objective_bounds(tok):
    logp, old, advs, mask = as_rows(tok)
    loss, metrics, _ = run(pl.gspo, logp, old, advs, mask, clip_low=0.01, clip_high=0.02)
    for t in range(len(tok)):
        a = advs[0][t]
        if mask[0][t] and a > 0:
            assert -loss[0, t].item() <= a * 1.02 + 1e-9
        if mask[0][t]:  # one sequence ratio for the whole row
            assert metrics["ratio"][0, t] == metrics["ratio"][0, mask[0].index(1)]


@settings(max_examples=40, deadline=None)
@given(tokens, st.data(), st.sampled_from(["ppo_clip", "gspo", "cispo", "reinforce"]))
def test_masked_tokens_never_contribute(tok, data, name):
    logp, old, advs, mask = as_rows(tok)
    base_loss, base_metrics, base_grad = run(getattr(pl, name), logp, old, advs, mask)
    for t, m in enumerate(mask[0]):
        if not m:
            logp[0][t] = data.draw(poison)
            old[0][t] = data.draw(poison)
            advs[0][t] = data.draw(poison)
    loss, metrics, grad = run(getattr(pl, name), logp, old, advs, mask)
    assert torch.equal(loss, base_loss) and torch.equal(grad, base_grad)
    assert all(torch.equal(metrics[k], base_metrics[k]) for k in base_metrics)
