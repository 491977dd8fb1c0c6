"""Advantage estimators against float64 references written with plain Python loops."""

from __future__ import annotations

import math
import random

import pytest
import torch
from loongsage_plugin_rl import advantages as adv

from loongsage_hookspecs import AdvantageInputs

# A hand-made batch: 10 rows, interleaved group ids, a group of one (9, 3), a group whose rewards
# are all equal (7), rows with holes in the mask (multi-turn) and a row with no trained token.
REWARDS = [1.0, 0.7, 0.0, 0.3, 0.7, 0.5, 2.0, 1.0, 1.0, -0.4]
GROUPS = [5, 2, 5, 9, 2, 5, 2, 7, 7, 3]
MASK = [
    [0, 0, 1, 1, 1, 0, 0],
    [0, 1, 1, 0, 1, 1, 0],  # gap: tool output between two turns
    [0, 0, 1, 1, 1, 1, 1],
    [0, 1, 1, 1, 0, 0, 0],
    [0, 0, 0, 1, 0, 0, 0],
    [0, 0, 0, 0, 0, 0, 0],  # nothing trained
    [1, 1, 0, 0, 1, 1, 1],
    [0, 1, 1, 0, 0, 0, 0],
    [0, 0, 1, 1, 1, 1, 0],
    [0, 1, 0, 1, 0, 1, 0],
]


def make_inputs(rewards=REWARDS, groups=GROUPS, mask=MASK, token_rewards=None, values=None) -> AdvantageInputs:
    return AdvantageInputs(
        rewards=torch.tensor(rewards, dtype=torch.float32),
        response_mask=torch.as_tensor(mask, dtype=torch.long),
        group_index=torch.tensor(groups, dtype=torch.long),
        token_rewards=None if token_rewards is None else torch.tensor(token_rewards, dtype=torch.float32),
        values=None if values is None else torch.tensor(values, dtype=torch.float32),
    )


def ref_group_members(rewards, groups, i):
    return [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]


def ref_grpo(rewards, groups, norm_std=True, eps=1e-6):
    out = []
    for i, r in enumerate(rewards):
        members = ref_group_members(rewards, groups, i)
        n = len(members)
        if n < 2 or max(members) == min(members):
            out.append(0.0)
            continue
        mean = sum(members) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1))
        out.append((r - mean) / (std + eps) if norm_std else r - mean)
    return out


def ref_rloo(rewards, groups):
    out = []
    for i, r in enumerate(rewards):
        others = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i] and j != i]
        if not others or len(set(others + [r])) == 1:
            out.append(0.0)
            continue
        out.append(r - sum(others) / len(others))
    return out


def broadcast(seq, mask):
    return [[seq[i] if mask[i][t] else 0.0 for t in range(len(mask[i]))] for i in range(len(mask))]


def ref_token_rewards(rewards, mask, token_rewards=None):
    out = []
    for i, row in enumerate(mask):
        r = [0.0] * len(row)
        pos = [t for t, m in enumerate(row) if m]
        if pos:
            r[pos[-1]] += rewards[i]
        if token_rewards is not None:
            for t in pos:
                r[t] += token_rewards[i][t]
        out.append(r)
    return out


def ref_returns(token_rewards, mask, gamma):
    """Closed form: G at the k-th trained token = sum_{j >= k} gamma^(j - k) r at the j-th."""
    out = []
    for i, row in enumerate(mask):
        pos = [t for t, m in enumerate(row) if m]
        g = [0.0] * len(row)
        for k, t in enumerate(pos):
            g[t] = sum(gamma ** (j - k) * token_rewards[i][pos[j]] for j in range(k, len(pos)))
        out.append(g)
    return out


def ref_whiten(x, mask, eps=1e-8, rows=None):
    cells = [(i, t) for i, row in enumerate(mask) for t, m in enumerate(row) if m and (rows is None or rows[i])]
    vals = [x[i][t] for i, t in cells]
    out = [[0.0] * len(row) for row in mask]
    if not vals or max(vals) == min(vals):
        return out
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / len(vals)
    for i, t in cells:
        out[i][t] = (x[i][t] - mean) / math.sqrt(var + eps)
    return out


def ref_gae(token_rewards, values, mask, gamma, lam):
    """Closed form: A at the k-th trained token = sum_j (gamma lam)^(j - k) delta_j."""
    adv_out, ret_out = [], []
    for i, row in enumerate(mask):
        pos = [t for t, m in enumerate(row) if m]
        v = [values[i][t] for t in pos] + [0.0]
        deltas = [token_rewards[i][pos[k]] + gamma * v[k + 1] - v[k] for k in range(len(pos))]
        a_row = [0.0] * len(row)
        r_row = [0.0] * len(row)
        for k, t in enumerate(pos):
            a_row[t] = sum((gamma * lam) ** (j - k) * deltas[j] for j in range(k, len(pos)))
            r_row[t] = a_row[t] + v[k]
        adv_out.append(a_row)
        ret_out.append(r_row)
    return adv_out, ret_out


def assert_close(actual: torch.Tensor, expected, atol=1e-5, rtol=1e-5):
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=rtol)


# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_std", [True, False])
def test_grpo_matches_reference(norm_std):
    out = adv.grpo(make_inputs(), norm_std=norm_std)
    assert out.returns is None
    assert_close(out.advantages, broadcast(ref_grpo(REWARDS, GROUPS, norm_std), MASK))
    # the groups of one (rows 3, 9) and the all-equal group (rows 7, 8) are exactly zero
    for row in (3, 7, 8, 9):
        assert out.advantages[row].abs().sum() == 0


def test_dr_grpo_is_grpo_without_std():
    out = adv.dr_grpo(make_inputs())
    assert_close(out.advantages, broadcast(ref_grpo(REWARDS, GROUPS, norm_std=False), MASK))
    assert torch.equal(out.advantages, adv.grpo(make_inputs(), norm_std=False).advantages)


def test_rloo_matches_leave_one_out_reference():
    out = adv.rloo(make_inputs())
    assert_close(out.advantages, broadcast(ref_rloo(REWARDS, GROUPS), MASK))


@pytest.mark.parametrize("estimator", [adv.grpo, adv.dr_grpo, adv.rloo, adv.reinforce_pp_baseline])
def test_group_estimators_are_zero_without_signal(estimator):
    # all rewards equal within each group, and awkward floats whose mean is not exact
    rewards = [0.1, 0.1, 0.1, 0.7, 0.7, 3.3]
    groups = [0, 0, 0, 1, 1, 2]
    mask = [[1, 1, 0]] * 6
    out = estimator(make_inputs(rewards, groups, mask)).advantages
    assert torch.equal(out, torch.zeros(6, 3))


def test_reinforce_pp_baseline_matches_reference():
    token_rewards = [[0.05 * (i - t) for t in range(7)] for i in range(10)]
    out = adv.reinforce_pp_baseline(make_inputs(token_rewards=token_rewards))
    seq_return = [REWARDS[i] + sum(token_rewards[i][t] for t in range(7) if MASK[i][t]) for i in range(10)]
    centred = []
    signal = []
    for i in range(10):
        members = ref_group_members(seq_return, GROUPS, i)
        has = len(members) > 1 and max(members) != min(members)
        signal.append(has)
        centred.append(seq_return[i] - sum(members) / len(members) if has else 0.0)
    expected = ref_whiten(broadcast(centred, MASK), MASK, rows=signal)
    assert_close(out.advantages, expected)
    silent = [i for i in range(10) if not signal[i]]
    assert 3 in silent and 9 in silent  # the groups of one
    for row in silent:  # no signal: exactly zero, even after whitening
        assert out.advantages[row].abs().sum() == 0
    raw = adv.reinforce_pp_baseline(make_inputs(token_rewards=token_rewards), whiten=False)
    assert_close(raw.advantages, broadcast(centred, MASK))


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("with_token_rewards", [False, True])
def test_reinforce_pp_matches_reference(gamma, with_token_rewards):
    rng = random.Random(3)
    token_rewards = [[rng.uniform(-0.2, 0.2) for _ in range(7)] for _ in range(10)] if with_token_rewards else None
    out = adv.reinforce_pp(make_inputs(token_rewards=token_rewards), gamma=gamma)
    returns = ref_returns(ref_token_rewards(REWARDS, MASK, token_rewards), MASK, gamma)
    assert_close(out.returns, returns)
    assert_close(out.advantages, ref_whiten(returns, MASK))
    raw = adv.reinforce_pp(make_inputs(token_rewards=token_rewards), gamma=gamma, whiten=False)
    assert_close(raw.advantages, returns)


def test_reinforce_pp_all_equal_returns_give_zero():
    out = adv.reinforce_pp(make_inputs(rewards=[0.3] * 10))
    assert torch.equal(out.advantages, torch.zeros(10, 7))


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_matches_reference(gamma, lam):
    rng = random.Random(7)
    values = [[rng.uniform(-1, 1) for _ in range(7)] for _ in range(10)]
    token_rewards = [[rng.uniform(-0.1, 0.1) for _ in range(7)] for _ in range(10)]
    inputs = make_inputs(token_rewards=token_rewards, values=values)
    exp_adv, exp_ret = ref_gae(ref_token_rewards(REWARDS, MASK, token_rewards), values, MASK, gamma, lam)
    raw = adv.gae(inputs, gamma=gamma, lam=lam, whiten=False)
    assert_close(raw.advantages, exp_adv)
    assert_close(raw.returns, exp_ret)
    whitened = adv.gae(inputs, gamma=gamma, lam=lam)
    assert_close(whitened.advantages, ref_whiten(exp_adv, MASK))
    assert_close(whitened.returns, exp_ret)


def test_gae_lambda_one_is_monte_carlo_minus_value():
    values = [[0.25 * t for t in range(7)] for _ in range(10)]
    out = adv.gae(make_inputs(values=values), gamma=1.0, lam=1.0, whiten=False)
    expected = [[(REWARDS[i] - values[i][t]) if MASK[i][t] else 0.0 for t in range(7)] for i in range(10)]
    assert_close(out.advantages, expected)


def test_values_under_mask_zero_change_nothing():
    rng = random.Random(1)
    values = [[rng.uniform(-1, 1) for _ in range(7)] for _ in range(10)]
    token_rewards = [[rng.uniform(-1, 1) for _ in range(7)] for _ in range(10)]
    base_gae = adv.gae(make_inputs(token_rewards=token_rewards, values=values))
    base_pp = adv.reinforce_pp(make_inputs(token_rewards=token_rewards), gamma=0.9)
    poisoned_values = [[values[i][t] if MASK[i][t] else float("nan") for t in range(7)] for i in range(10)]
    poisoned_rewards = [[token_rewards[i][t] if MASK[i][t] else float("inf") for t in range(7)] for i in range(10)]
    gae2 = adv.gae(make_inputs(token_rewards=poisoned_rewards, values=poisoned_values))
    pp2 = adv.reinforce_pp(make_inputs(token_rewards=poisoned_rewards), gamma=0.9)
    assert torch.equal(base_gae.advantages, gae2.advantages) and torch.equal(base_gae.returns, gae2.returns)
    assert torch.equal(base_pp.advantages, pp2.advantages)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"])
def test_row_order_does_not_matter(name):
    rng = random.Random(11)
    values = [[rng.uniform(-1, 1) for _ in range(7)] for _ in range(10)]
    perm = list(range(10))
    rng.shuffle(perm)
    fn = getattr(adv, name)
    kwargs = {"values": values} if name == "gae" else {}
    base = fn(make_inputs(**kwargs)).advantages
    shuffled_kwargs = {"values": [values[i] for i in perm]} if name == "gae" else {}
    shuffled = fn(make_inputs([REWARDS[i] for i in perm], [GROUPS[i] for i in perm], [MASK[i] for i in perm],
                              **shuffled_kwargs)).advantages
    torch.testing.assert_close(shuffled, base[perm], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_single_row_and_empty_batch(name):
    fn = getattr(adv, name)
    one = fn(make_inputs([2.5], [0], [[0, 1, 1]])).advantages
    assert torch.equal(one, torch.zeros(1, 3))
    empty = fn(make_inputs([], [], torch.zeros(0, 4, dtype=torch.long))).advantages
    assert empty.shape == (0, 4)


def test_output_dtype_follows_rewards():
    inputs = make_inputs()
    inputs.rewards = inputs.rewards.double()
    assert adv.grpo(inputs).advantages.dtype == torch.float64
    inputs.rewards = torch.tensor([1, 0, 1, 0, 1, 0, 1, 0, 1, 0])
    assert adv.grpo(inputs).advantages.dtype == torch.float32


def test_errors_name_the_bad_input():
    with pytest.raises(ValueError, match="rewards must be finite; rows \\[2\\]"):
        adv.grpo(make_inputs(rewards=REWARDS[:2] + [float("nan")] + REWARDS[3:]))
    with pytest.raises(ValueError, match="gae: inputs.values is None"):
        adv.gae(make_inputs())
    with pytest.raises(ValueError, match="gae: values hold NaN"):
        adv.gae(make_inputs(values=[[float("nan")] * 7] * 10))
    with pytest.raises(ValueError, match="group_index must have shape \\[10\\]"):
        adv.grpo(make_inputs(groups=GROUPS[:9]))
    with pytest.raises(ValueError, match="values has shape \\(10, 6\\)"):
        adv.gae(make_inputs(values=[[0.0] * 6] * 10))
    with pytest.raises(TypeError, match="grpo: argument 'norm_std' must be true or false"):
        adv.grpo(make_inputs(), norm_std="yes")
    with pytest.raises(ValueError, match="reinforce_pp: argument 'gamma' must be <= 1.0"):
        adv.reinforce_pp(make_inputs(), gamma=1.5)
    with pytest.raises(ValueError, match="gae: argument 'lam' must be >= 0.0"):
        adv.gae(make_inputs(values=[[0.0] * 7] * 10), lam=-0.1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'gama'"):
        adv.reinforce_pp(make_inputs(), gama=0.9)
    with pytest.raises(TypeError, match="group_index must be an integer tensor"):
        inputs = make_inputs()
        inputs.group_index = inputs.group_index.float()
        adv.grpo(inputs)


# ------------------------------------------------------------------------------------------------
# Token rewards in sequence-level estimators, and trajectories split into segments
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_sequence_estimators_score_the_summed_token_rewards(name):
    # equal scores, different KL penalties folded into the token rewards: a signal appears
    rewards = [1.0, 1.0, 1.0]
    mask = [[1, 1, 0], [1, 1, 1], [0, 1, 1]]
    penalty = [[-0.1, -0.1, -5.0], [-0.3, 0.0, -0.2], [-9.0, 0.0, -0.05]]  # off-mask values are ignored
    plain = getattr(adv, name)(make_inputs(rewards, [0, 0, 0], mask)).advantages
    assert torch.count_nonzero(plain) == 0
    folded = getattr(adv, name)(make_inputs(rewards, [0, 0, 0], mask, token_rewards=penalty)).advantages
    assert torch.count_nonzero(folded) > 0
    # the row with the smallest penalty (-0.05) gets the largest advantage
    first = [folded[i][torch.tensor(mask[i]).bool()][0].item() for i in range(3)]
    assert first[2] > first[0] > first[1]
    if name == "dr_grpo":
        returns = [1.0 - 0.2, 1.0 - 0.5, 1.0 - 0.05]
        mean = sum(returns) / 3
        assert first == pytest.approx([r - mean for r in returns], abs=1e-6)


def segmented(name, **kw):
    """Group 0: trajectory A in three segments (rows 0-2, score 1), B and C one row each (score 0);
    group 1: D (two segments, score 0.5) and E (score 0.5, no signal)."""
    return AdvantageInputs(
        rewards=torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.5]),
        response_mask=torch.tensor([[1, 1, 0]] * 8),
        group_index=torch.tensor([0, 0, 0, 0, 0, 1, 1, 1]),
        sample_index=torch.tensor([10, 10, 10, 11, 12, 13, 13, 14]), **kw)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_a_trajectory_in_several_segments_counts_once(name):
    out = getattr(adv, name)(segmented(name)).advantages
    # per trajectory, exactly what three one-row trajectories with scores 1, 0, 0 give
    single = getattr(adv, name)(make_inputs([1.0, 0.0, 0.0], [0, 0, 0], [[1, 1, 0]] * 3)).advantages
    assert out[0].tolist() == out[1].tolist() == out[2].tolist()  # broadcast onto every segment
    if name != "reinforce_pp_baseline":  # whitening spans all tokens, so only the signs compare
        assert out[0, 0].item() == pytest.approx(single[0, 0].item())
        assert out[3, 0].item() == pytest.approx(single[1, 0].item())
    assert out[0, 0] > 0 > out[3, 0]
    assert out[3].tolist() == out[4].tolist()
    assert torch.count_nonzero(out[5:]) == 0  # equal scores: no signal, however many segments
    if name == "grpo":  # counted per row, A would weigh three times: mean 0.6 instead of 1/3
        rowwise = adv.grpo(make_inputs([1.0, 1.0, 1.0, 0.0, 0.0], [0] * 5, [[1, 1, 0]] * 5)).advantages
        assert rowwise[0, 0].item() != pytest.approx(out[0, 0].item())


def test_token_rewards_of_all_segments_add_to_the_trajectory_score():
    penalty = torch.zeros(8, 3)
    penalty[0, 0] = penalty[2, 1] = -0.25  # two segments of A, -0.5 in all
    out = adv.dr_grpo(segmented("dr_grpo", token_rewards=penalty)).advantages
    mean = (0.5 + 0.0 + 0.0) / 3
    assert out[1, 0].item() == pytest.approx(0.5 - mean, abs=1e-6)
    assert out[3, 0].item() == pytest.approx(-mean, abs=1e-6)


def test_segments_of_one_trajectory_must_agree():
    bad = segmented("grpo")
    bad.rewards[1] = 0.0
    with pytest.raises(ValueError, match="sample_index"):
        adv.grpo(bad)
    with pytest.raises(TypeError, match="sample_index must be an integer"):
        adv.grpo(attrs_evolve(segmented("grpo"), sample_index=torch.zeros(8)))


def attrs_evolve(inputs, **changes):
    import attrs

    return attrs.evolve(inputs, **changes)


def _split_episode():
    """One episode of 7 trained tokens with per-token rewards and values, as one row and as three
    segments (rows 0-2, in order, with their own padding), beside an unrelated one-row trajectory.
    Returns (whole, split, picks): ``picks[k]`` maps token k of the episode to (row, column) in
    ``split``."""
    rewards_tok = [0.1, -0.2, 0.0, 0.3, -0.1, 0.05, 0.2]
    values_tok = [0.5, 0.4, -0.3, 0.2, 0.1, 0.0, 0.6]
    score, other_score = 1.5, -0.5
    whole = AdvantageInputs(
        rewards=torch.tensor([score, other_score]),
        response_mask=torch.tensor([[1] * 7 + [0], [0, 1, 1, 1, 0, 0, 0, 0]]),
        group_index=torch.tensor([0, 0]),
        token_rewards=torch.tensor([rewards_tok + [0.0], [0.0, 0.1, 0.1, 0.1, 0, 0, 0, 0]]),
        values=torch.tensor([values_tok + [0.0], [0.0, 0.2, 0.1, 0.3, 0, 0, 0, 0]]))
    # segment 0: tokens 0-1 after a 1-token prompt; segment 1: tokens 2-4 after a 2-token context
    # (with a tool-output hole); segment 2: tokens 5-6
    picks = [(0, 1), (0, 2), (1, 2), (1, 4), (1, 5), (2, 1), (2, 2)]
    n_rows, width = 4, 8
    mask = torch.zeros(n_rows, width, dtype=torch.long)
    tok_r = torch.zeros(n_rows, width)
    vals = torch.zeros(n_rows, width)
    for k, (r, c) in enumerate(picks):
        mask[r, c], tok_r[r, c], vals[r, c] = 1, rewards_tok[k], values_tok[k]
    mask[3, 1:4] = 1
    tok_r[3, 1:4] = 0.1
    vals[3, 1:4] = torch.tensor([0.2, 0.1, 0.3])
    split = AdvantageInputs(
        rewards=torch.tensor([score, score, score, other_score]), response_mask=mask,
        group_index=torch.tensor([0, 0, 0, 0]), token_rewards=tok_r, values=vals,
        sample_index=torch.tensor([4, 4, 4, 9]))
    return whole, split, picks


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0)])
@pytest.mark.parametrize("name", ["reinforce_pp", "gae"])
def test_token_level_estimators_treat_segments_as_one_episode(name, gamma, lam):
    whole, split, picks = _split_episode()
    kw = {"gamma": gamma, "whiten": False} | ({"lam": lam} if name == "gae" else {})
    one = getattr(adv, name)(whole, **kw)
    seg = getattr(adv, name)(split, **kw)
    for k, (r, c) in enumerate(picks):
        assert seg.advantages[r, c].item() == pytest.approx(one.advantages[0, k].item(), abs=1e-6)
        assert seg.returns[r, c].item() == pytest.approx(one.returns[0, k].item(), abs=1e-6)
    assert seg.advantages[3, 1:4].tolist() == pytest.approx(one.advantages[1, 1:4].tolist(), abs=1e-6)
    # the score is counted once: on the last token of the last segment, not at every segment's end
    assert torch.count_nonzero(seg.advantages * (1 - split.response_mask)) == 0
    rowwise = getattr(adv, name)(attrs_evolve(split, sample_index=None), **kw)
    assert rowwise.returns[0, 2].item() != pytest.approx(seg.returns[0, 2].item())  # a segment end
