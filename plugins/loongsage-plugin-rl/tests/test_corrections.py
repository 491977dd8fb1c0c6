"""Off-policy corrections (TIS, M2PO, OPSM) against plain-Python float64 references."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loongsage_plugin_rl import corrections as corr

from loongsage_hookspecs import CorrectionInputs

MASK = [
    [0, 1, 1, 1, 0, 0],
    [1, 1, 0, 1, 1, 1],
    [0, 0, 0, 0, 0, 0],
    [0, 0, 1, 1, 0, 0],
    [1, 1, 1, 1, 1, 0],
]


def case(seed, spread=0.6):
    rng = random.Random(seed)
    rollout = [[rng.uniform(-3, -0.1) for _ in range(6)] for _ in MASK]
    old = [[x + rng.uniform(-spread, spread) for x in row] for row in rollout]
    return old, rollout


def make(old, rollout, mask=MASK, advantages=None, logprobs=None):
    f = lambda x: None if x is None else torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return CorrectionInputs(old_logprobs=f(old), rollout_logprobs=f(rollout), response_mask=torch.tensor(mask),
                            advantages=f(advantages), logprobs=f(logprobs))


def tis_case():
    """Rows built to land inside and outside every bound tested: row 0 near on-policy, row 1
    drifted up (+0.45 per token), row 3 down (-0.5), row 4 alternating +-0.6 per token."""
    rng = random.Random(0)
    rollout = [[rng.uniform(-3, -0.1) for _ in range(6)] for _ in MASK]
    drift = [lambda t: 0.02 * (-1) ** t, lambda t: 0.45, lambda t: 0.0, lambda t: -0.5, lambda t: 0.6 * (-1) ** t]
    old = [[x + drift[i](t) + rng.uniform(-0.01, 0.01) for t, x in enumerate(row)] for i, row in enumerate(rollout)]
    return old, rollout


def positions(mask, i):
    return [t for t, m in enumerate(mask[i]) if m]


def ref_tis(old, rollout, mask, level, mode, lower, upper):
    """(weights, mask or None, is_clip_ratio, is_weight_mean) with plain loops."""
    weights = [[1.0] * len(r) for r in mask]
    keep = [[1.0] * len(r) for r in mask]
    outside = effective = n = 0
    for i in range(len(mask)):
        pos = positions(mask, i)
        diffs = [old[i][t] - rollout[i][t] for t in pos]
        for k, t in enumerate(pos):
            if level == "token":
                log_w = diffs[k]
            elif level == "sequence":
                log_w = sum(diffs)
            else:
                log_w = sum(diffs) / len(diffs)
            w = math.exp(min(max(log_w, -20), 20))
            out = w < lower or w > upper
            outside += out
            n += 1
            if mode == "clip":
                weights[i][t] = min(max(w, lower), upper)
            else:
                weights[i][t] = 0.0 if out else w
                keep[i][t] = 0.0 if out else 1.0
            effective += weights[i][t] * keep[i][t]
    return weights, (keep if mode == "mask" else None), outside / n, effective / n


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize(("mode", "lower", "upper"), [("clip", None, 1.5), ("clip", 0.8, 1.2), ("mask", None, 1.6),
                                                      ("mask", 0.7, 1.3)])
def test_tis_matches_reference(level, mode, lower, upper):
    old, rollout = tis_case()
    kwargs = {"level": level, "mode": mode, "upper": upper}
    if lower is not None:
        kwargs["lower"] = lower
    out = corr.tis(make(old, rollout), **kwargs)
    eff_lower = lower if lower is not None else (0.0 if mode == "clip" else 1 / upper)
    w, keep, clip_ratio, weight_mean = ref_tis(old, rollout, MASK, level, mode, eff_lower, upper)
    torch.testing.assert_close(out.weights, torch.tensor(w, dtype=torch.float64))
    if keep is None:
        assert out.mask is None
    else:
        torch.testing.assert_close(out.mask, torch.tensor(keep, dtype=torch.float64))
        if level != "token":  # sequence levels mask whole rows
            for i in range(len(MASK)):
                assert len({out.mask[i, t].item() for t in positions(MASK, i)}) <= 1
    assert out.metrics["is_clip_ratio"] == pytest.approx(clip_ratio)
    assert out.metrics["is_weight_mean"] == pytest.approx(weight_mean)
    assert 0 < clip_ratio < 1  # the case exercises both sides of the bounds
    assert not out.weights.requires_grad


def test_tis_mismatch_metrics():
    old, rollout = case(1)
    out = corr.tis(make(old, rollout))
    diffs = [old[i][t] - rollout[i][t] for i in range(len(MASK)) for t in positions(MASK, i)]
    assert out.metrics["is_approx_k3_kl"] == pytest.approx(sum(math.exp(r) - r - 1 for r in diffs) / len(diffs))
    assert out.metrics["logprob_abs_diff_mean"] == pytest.approx(sum(abs(r) for r in diffs) / len(diffs))
    assert out.metrics["logprob_abs_diff_max"] == pytest.approx(max(abs(r) for r in diffs))
    # the sign matters: r = old - rollout, and the k3 value is not symmetric in r
    swapped = corr.tis(make(rollout, old)).metrics["is_approx_k3_kl"]
    assert swapped != pytest.approx(out.metrics["is_approx_k3_kl"])


def test_tis_extreme_and_empty():
    old = [[0.0, -0.01, -700.0]]
    rollout = [[-900.0, -0.02, -0.01]]
    out = corr.tis(make(old, rollout, mask=[[1, 1, 1]]), level="sequence")
    assert torch.isfinite(out.weights).all()
    empty = corr.tis(make([[0.0, 0.0]], [[0.0, 0.0]], mask=[[0, 0]]), mode="mask", upper=2.0)
    assert torch.equal(empty.weights, torch.ones(1, 2, dtype=torch.float64))
    assert torch.equal(empty.mask, torch.ones(1, 2, dtype=torch.float64))
    assert all(v == 0.0 for v in empty.metrics.values())


def ref_m2po(old, rollout, mask, tau):
    """The algorithm as stated: drop the token with the largest r^2 until the mean of the rest is <= tau."""
    kept = {(i, t): (old[i][t] - rollout[i][t]) ** 2 for i in range(len(mask)) for t in positions(mask, i)}
    total = len(kept)
    while kept and sum(kept.values()) / len(kept) > tau:
        del kept[max(kept, key=kept.get)]
    return set(kept), total


@pytest.mark.parametrize(("spread", "tau"), [(0.6, 0.04), (0.3, 0.04), (0.05, 0.04), (1.0, 0.2)])
def test_m2po_matches_iterative_reference(spread, tau):
    old, rollout = case(2, spread)
    out = corr.m2po(make(old, rollout), tau=tau)
    kept, total = ref_m2po(old, rollout, MASK, tau)
    assert out.weights is None
    for i, row in enumerate(MASK):
        for t, m in enumerate(row):
            assert out.mask[i, t].item() == (1.0 if (not m or (i, t) in kept) else 0.0)
    assert out.metrics["m2po_masked_ratio"] == pytest.approx((total - len(kept)) / total)
    if kept:
        moment = sum((old[i][t] - rollout[i][t]) ** 2 for i, t in kept) / len(kept)
        assert out.metrics["m2po_second_moment_kept"] == pytest.approx(moment) and moment <= tau


def test_m2po_keeps_everything_inside_the_trust_region():
    old, rollout = case(3, spread=0.05)
    out = corr.m2po(make(old, rollout), tau=0.04)
    assert torch.equal(out.mask, torch.ones(5, 6, dtype=torch.float64))
    assert out.metrics["m2po_masked_ratio"] == 0.0


def ref_opsm(ref, current, advs, mask, delta):
    dropped = set()
    for i in range(len(mask)):
        pos = positions(mask, i)
        if not pos:
            continue
        kl = sum(ref[i][t] - current[i][t] for t in pos) / len(pos)
        adv = sum(advs[i][t] for t in pos) / len(pos)
        if adv < 0 and kl > delta:
            dropped.add(i)
    return dropped


@pytest.mark.parametrize("behavior", ["rollout", "old"])
def test_opsm_matches_reference(behavior):
    old, rollout = case(4, spread=0.1)
    rng = random.Random(5)
    current = [[x + rng.uniform(-0.3, 0.3) for x in row] for row in old]
    # advantages: rows 0 and 1 negative, row 3 positive, row 4 negative
    advs = [[a] * 6 for a in (-1.0, -0.5, 0.0, 0.8, -0.2)]
    ref = rollout if behavior == "rollout" else old
    for i, sign in ((0, -1), (1, 1), (3, -1), (4, -1)):  # make rows 0, 3, 4 clearly off-policy
        for t in positions(MASK, i):
            current[i][t] = ref[i][t] + sign * 0.2
    out = corr.opsm(make(old, rollout, advantages=advs, logprobs=current), delta=0.05, behavior=behavior)
    dropped = ref_opsm(ref, current, advs, MASK, 0.05)
    assert dropped == {0, 4}  # row 3 is off-policy but has a positive advantage
    for i, row in enumerate(MASK):
        for t, m in enumerate(row):
            assert out.mask[i, t].item() == (0.0 if (m and i in dropped) else 1.0)
    assert out.metrics["opsm_clipfrac"] == pytest.approx(2 / 4)  # 4 rows have trained tokens


def test_opsm_needs_current_logprobs_and_advantages():
    old, rollout = case(6)
    with pytest.raises(ValueError, match="opsm: inputs.logprobs .* is None; OPSM runs at stage post_forward"):
        corr.opsm(make(old, rollout, advantages=old))
    with pytest.raises(ValueError, match="opsm: inputs.advantages is None"):
        corr.opsm(make(old, rollout, logprobs=old))
    with pytest.raises(ValueError, match="opsm: argument 'behavior' must be one of \\['rollout', 'old'\\]"):
        corr.opsm(make(old, rollout, advantages=old, logprobs=old), behavior="current")


def test_argument_errors():
    old, rollout = case(7)
    inputs = make(old, rollout)
    with pytest.raises(ValueError, match="tis: argument 'level' must be one of"):
        corr.tis(inputs, level="seq")
    with pytest.raises(ValueError, match="tis: argument 'lower' must be < 2.0"):
        corr.tis(inputs, lower=3.0)
    with pytest.raises(ValueError, match="tis: mode 'mask' with upper=0.9 <= 1 needs an explicit 'lower'"):
        corr.tis(inputs, mode="mask", upper=0.9)
    with pytest.raises(ValueError, match="m2po: argument 'tau' must be > 0.0"):
        corr.m2po(inputs, tau=0.0)
    with pytest.raises(ValueError, match="tis: rollout_logprobs has shape \\(5, 5\\)"):
        corr.tis(make(old, [row[:5] for row in rollout]))
    with pytest.raises(TypeError, match="m2po: expected CorrectionInputs"):
        corr.m2po(old)


# ------------------------------------------------------------------------------------------------
# Property tests
# ------------------------------------------------------------------------------------------------

row_tokens = st.lists(st.tuples(st.floats(-10, 0), st.floats(-3, 3), st.booleans()), min_size=1, max_size=10)
poison = st.sampled_from([float("nan"), float("inf"), float("-inf"), 0.0, -1e6])


def as_inputs(rows):
    width = max(len(r) for r in rows)
    pad = lambda r, v: r + [v] * (width - len(r))  # noqa: E731
    rollout = [pad([x[0] for x in r], 0.0) for r in rows]
    old = [pad([x[0] + x[1] for x in r], 0.0) for r in rows]
    mask = [pad([int(x[2]) for x in r], 0) for r in rows]
    return old, rollout, mask


@settings(max_examples=60, deadline=None)
@given(st.lists(row_tokens, min_size=1, max_size=4), st.sampled_from(["token", "sequence", "geometric"]),
       st.sampled_from(["clip", "mask"]), st.floats(0.0, 0.99), st.floats(1.01, 10.0))
def test_is_weights_stay_within_bounds(rows, level, mode, lower, upper):
    old, rollout, mask = as_inputs(rows)
    out = corr.tis(make(old, rollout, mask), level=level, mode=mode, lower=lower, upper=upper)
    trained = torch.tensor(mask) == 1
    w = out.weights[trained]
    assert torch.isfinite(out.weights).all()
    assert (out.weights[~trained] == 1).all()
    if mode == "clip":
        assert ((w >= lower) & (w <= upper)).all()
    else:
        kept = out.mask[trained] == 1
        assert ((w[kept] >= lower) & (w[kept] <= upper)).all() and (w[~kept] == 0).all()
        assert ((out.mask == 0) | (out.mask == 1)).all()
    assert 0.0 <= out.metrics["is_clip_ratio"] <= 1.0


@settings(max_examples=40, deadline=None)
@given(st.lists(row_tokens, min_size=1, max_size=4), st.data())
def test_values_under_mask_zero_change_nothing(rows, data):
    old, rollout, mask = as_inputs(rows)
    advs = [[-1.0 if i % 2 else 0.5] * len(mask[0]) for i in range(len(mask))]
    current = [[x - 0.1 for x in row] for row in old]
    calls = [
        lambda o, r, a, c: corr.tis(make(o, r, mask), level="geometric", mode="mask", upper=3.0),
        lambda o, r, a, c: corr.m2po(make(o, r, mask), tau=0.5),
        lambda o, r, a, c: corr.opsm(make(o, r, mask, advantages=a, logprobs=c), delta=0.01),
    ]
    base = [call(old, rollout, advs, current) for call in calls]
    for i, row in enumerate(mask):
        for t, m in enumerate(row):
            if not m:
                old[i][t], rollout[i][t] = data.draw(poison), data.draw(poison)
                advs[i][t], current[i][t] = data.draw(poison), data.draw(poison)
    for call, expected in zip(calls, base, strict=True):
        got = call(old, rollout, advs, current)
        for field in ("weights", "mask"):
            a, b = getattr(got, field), getattr(expected, field)
            assert (a is None and b is None) or torch.equal(a, b)
        assert got.metrics == expected.metrics
