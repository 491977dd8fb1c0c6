"""KL estimators against per-token float64 references."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loongsage_plugin_rl import kl

from loongsage_hookspecs import KLInputs

MASK = [[0, 1, 1, 1, 0], [1, 1, 0, 1, 1], [0, 0, 0, 0, 0]]


def case(seed=0):
    rng = random.Random(seed)
    logp = [[rng.uniform(-4, -0.05) for _ in range(5)] for _ in range(3)]
    ref = [[x + rng.uniform(-1.5, 1.5) for x in row] for row in logp]
    return logp, ref


def run(fn, logp, ref, mask=MASK, **kwargs):
    lp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    out = fn(KLInputs(logprobs=lp, ref_logprobs=torch.tensor(ref, dtype=torch.float64),
                      response_mask=torch.tensor(mask)), **kwargs)
    assert out.requires_grad  # usable as a loss term; the host detaches it to fold it into rewards
    (grad,) = torch.autograd.grad(out.sum(), lp)
    return out.detach(), grad


def ref_k(name, d, clamp=None):
    """Value and d/d logp of each estimator at d = logp - ref."""
    r = -d
    if name == "k1":
        value, grad = d, 1.0
    elif name == "k2":
        value, grad = 0.5 * d * d, d
    else:  # k3 family: exp(r) - r - 1 with r = ref - logp clamped to [-20, 20]
        rc = min(max(r, -20.0), 20.0)
        value = math.exp(rc) - rc - 1
        grad = (1.0 - math.exp(rc)) if -20 < r < 20 else 0.0
        if name == "low_var_kl" and clamp is None:
            clamp = 10.0
    if clamp is not None and abs(value) > clamp:
        value, grad = math.copysign(clamp, value), 0.0
    return value, grad


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "low_var_kl"])
@pytest.mark.parametrize("clamp", [None, 0.3])
def test_estimators_match_reference(name, clamp):
    logp, ref = case(1)
    logp[1][0], ref[1][0] = -0.05, -14.0  # a token the reference almost never samples
    kwargs = {} if clamp is None else {"clamp": clamp}
    value, grad = run(getattr(kl, name), logp, ref, **kwargs)
    for i, row in enumerate(MASK):
        for t, m in enumerate(row):
            if not m:
                assert value[i, t] == 0 and grad[i, t] == 0
                continue
            v, g = ref_k(name, logp[i][t] - ref[i][t], clamp)
            assert value[i, t].item() == pytest.approx(v, rel=1e-12, abs=1e-12)
            assert grad[i, t].item() == pytest.approx(g, rel=1e-12, abs=1e-12)


def test_low_var_kl_clamps_extremes_and_k3_stays_finite():
    logp = [[-30.0, -0.01]]
    ref = [[-0.01, -60.0]]
    mask = [[1, 1]]
    k3_value, k3_grad = run(kl.k3, logp, ref, mask)
    assert torch.isfinite(k3_value).all() and torch.isfinite(k3_grad).all()
    assert k3_value[0, 0].item() == pytest.approx(math.exp(20.0) - 21.0)  # log-ratio clamped at 20
    low, _ = run(kl.low_var_kl, logp, ref, mask)
    assert low[0, 0].item() == 10.0 and 0 < low[0, 1].item() <= 10.0


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "low_var_kl"])
def test_poison_under_mask_is_ignored(name):
    logp, ref = case(2)
    base, base_grad = run(getattr(kl, name), logp, ref)
    for i, row in enumerate(MASK):
        for t, m in enumerate(row):
            if not m:
                logp[i][t], ref[i][t] = float("nan"), float("-inf")
    value, grad = run(getattr(kl, name), logp, ref)
    assert torch.equal(value, base) and torch.equal(grad, base_grad)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(-50, 0), st.floats(-50, 0)), min_size=1, max_size=10))
def test_k2_k3_are_never_negative(pairs):
    logp = [[p for p, _ in pairs]]
    ref = [[r for _, r in pairs]]
    mask = [[1] * len(pairs)]
    for fn in (kl.k2, kl.k3, kl.low_var_kl):
        value, grad = run(fn, logp, ref, mask)
        assert (value >= 0).all() and torch.isfinite(value).all() and torch.isfinite(grad).all()


def test_argument_errors():
    logp, ref = case(3)
    inputs = KLInputs(logprobs=torch.tensor(logp), ref_logprobs=torch.tensor(ref), response_mask=torch.tensor(MASK))
    with pytest.raises(ValueError, match="k1: argument 'clamp' must be > 0.0"):
        kl.k1(inputs, clamp=0)
    with pytest.raises(ValueError, match="k3: argument 'log_ratio_clamp' must be > 0.0"):
        kl.k3(inputs, log_ratio_clamp=-1)
    with pytest.raises(TypeError, match="k2: expected KLInputs"):
        kl.k2(logp)
    with pytest.raises(ValueError, match="k3: ref_logprobs has shape \\(3, 4\\)"):
        kl.k3(KLInputs(logprobs=torch.tensor(logp), ref_logprobs=torch.tensor(ref)[:, :4],
                       response_mask=torch.tensor(MASK)))
    assert kl.low_var_kl(inputs, clamp=None).max() >= 0  # None turns the default clamp off
