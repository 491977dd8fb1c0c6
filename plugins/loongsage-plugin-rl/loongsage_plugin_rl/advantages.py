"""Advantage estimators: ``fn(inputs: AdvantageInputs, **args) -> AdvantageOutput``.

Every estimator returns per-token advantages ``[B, T]`` that are 0 wherever the response mask
is 0. Statistics are computed in float64 and the result is cast back to the rewards' dtype
(float32 for integer rewards). Rows whose group carries no learning signal (a group of one row,
or a group whose rewards are all equal) get exactly 0, never NaN.

Token-level rewards (used by ``reinforce_pp`` and ``gae``): the sequence score sits on the last
trained token of its trajectory and ``token_rewards`` (when given, e.g. a KL penalty folded into
the reward) are added on every trained token. Discounting steps over trained tokens only: tokens
with mask 0 (prompt, tool output, padding) neither receive reward nor count as a time step. A
trajectory split into several segments (rows sharing a ``sample_index``, in segment order) is one
episode: the score sits on its last segment only, and the return (and GAE's next value and
advantage) of a segment's last trained token continues from the first trained token of the next.

Sequence-level estimators (``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp_baseline``) score a
trajectory by its score plus the sum of its ``token_rewards`` over all its trained tokens (what
verl does with a KL penalty in the reward: the group statistics see the penalised sequence
return). Their group statistics are over trajectories, not rows: rows sharing a ``sample_index``
(the segments of one trajectory) count once, and the trajectory's advantage is broadcast onto the
trained tokens of every one of its segments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from loongsage_hookspecs import AdvantageInputs, AdvantageOutput

from . import _checks as chk

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


class _Rows(NamedTuple):
    """Validated inputs: bool mask ``[B, T]``, float64 rewards ``[B]``, output dtype."""

    mask: "torch.Tensor"
    rewards: "torch.Tensor"
    dtype: "torch.dtype"


class _GroupStats(NamedTuple):
    """Per-row statistics of the row's group (all ``[B]``, float64 / bool)."""

    mean: "torch.Tensor"
    std_unbiased: "torch.Tensor"
    count: "torch.Tensor"
    has_signal: "torch.Tensor"


def _rows(owner: str, inputs: AdvantageInputs) -> _Rows:
    import torch

    if not isinstance(inputs, AdvantageInputs):
        raise TypeError(f"{owner}: expected AdvantageInputs, got {type(inputs).__name__}")
    mask = chk.mask_bool(owner, inputs.response_mask)
    rewards = chk.tensor1d(owner, "rewards", inputs.rewards, mask.shape[0])
    bad = (~torch.isfinite(rewards.double())).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"{owner}: rewards must be finite; rows {bad[:10]} hold NaN or inf")
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return _Rows(mask, rewards.to(torch.float64), dtype)


class _Samples(NamedTuple):
    """Trajectory-level view of the rows: ``inv`` ``[B]`` the sample of each row, ``group`` ``[S]``
    the group of each sample, ``score`` ``[S]`` float64 its score plus its summed token rewards."""

    inv: "torch.Tensor"
    group: "torch.Tensor"
    score: "torch.Tensor"


def _int_index(owner: str, name: str, value: "torch.Tensor", rows: int) -> "torch.Tensor":
    import torch

    index = chk.tensor1d(owner, name, value, rows)
    if index.is_floating_point() or index.dtype == torch.bool:
        raise TypeError(f"{owner}: {name} must be an integer tensor, got dtype {index.dtype}")
    return index


def _row_token_reward_sums(owner: str, inputs: AdvantageInputs, mask: "torch.Tensor") -> "torch.Tensor | None":
    """Float64 ``[B]``: each row's ``token_rewards`` summed over its trained tokens (``None`` without)."""
    import torch

    if inputs.token_rewards is None:
        return None
    extra = chk.float_tensor2d(owner, "token_rewards", inputs.token_rewards, mask).to(torch.float64)
    if not torch.isfinite(extra[mask]).all():
        raise ValueError(f"{owner}: token_rewards hold NaN or inf on trained tokens")
    return torch.where(mask, extra, torch.zeros((), dtype=torch.float64, device=mask.device)).sum(dim=1)


def _samples(owner: str, inputs: AdvantageInputs, rows: _Rows) -> _Samples:
    """Group the rows into trajectories (``sample_index``; every row its own without one) and
    score each once: its score (equal on all its rows) plus its summed token rewards."""
    import torch

    n_rows = rows.mask.shape[0]
    group = _int_index(owner, "group_index", inputs.group_index, n_rows).to(rows.mask.device)
    if inputs.sample_index is None:
        inv = torch.arange(n_rows, device=rows.mask.device)
    else:
        sample = _int_index(owner, "sample_index", inputs.sample_index, n_rows).to(rows.mask.device)
        _, inv = torch.unique(sample, return_inverse=True)
    n_samples = int(inv.max()) + 1 if n_rows else 0
    score = rows.rewards.new_zeros(n_samples).scatter_reduce(0, inv, rows.rewards, "amax", include_self=False)
    low = rows.rewards.new_zeros(n_samples).scatter_reduce(0, inv, rows.rewards, "amin", include_self=False)
    g_max = group.new_zeros(n_samples).scatter_reduce(0, inv, group, "amax", include_self=False)
    g_min = group.new_zeros(n_samples).scatter_reduce(0, inv, group, "amin", include_self=False)
    bad = ((score != low) | (g_max != g_min)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"{owner}: the rows of one trajectory (same sample_index) must share their rewards and "
                         f"group_index; samples {bad[:10]} do not")
    extra = _row_token_reward_sums(owner, inputs, rows.mask)
    if extra is not None:
        score = score + score.new_zeros(n_samples).index_add_(0, inv, extra)
    return _Samples(inv, g_max, score)


def _group_stats(index: "torch.Tensor", values: "torch.Tensor") -> _GroupStats:
    """Mean, unbiased std and size of each item's group, and whether the group has any spread
    (``index`` and ``values`` are ``[N]``, one entry per trajectory)."""
    import torch

    n_items = values.shape[0]
    if n_items == 0:
        empty = values.new_zeros(0)
        return _GroupStats(empty, empty, empty, torch.zeros(0, dtype=torch.bool, device=values.device))
    _, inv = torch.unique(index.to(values.device), return_inverse=True)
    n_groups = int(inv.max()) + 1
    count = values.new_zeros(n_groups).index_add_(0, inv, torch.ones_like(values))
    mean = values.new_zeros(n_groups).index_add_(0, inv, values) / count
    dev = values - mean[inv]
    sq = values.new_zeros(n_groups).index_add_(0, inv, dev * dev)
    var = torch.where(count > 1, sq / (count - 1).clamp_min(1), torch.zeros_like(sq))
    gmax = values.new_full((n_groups,), float("-inf")).scatter_reduce(0, inv, values, "amax")
    gmin = values.new_full((n_groups,), float("inf")).scatter_reduce(0, inv, values, "amin")
    has_signal = (count > 1) & (gmax > gmin)
    return _GroupStats(mean[inv], var.sqrt()[inv], count[inv], has_signal[inv])


def _broadcast(seq_adv: "torch.Tensor", mask: "torch.Tensor", dtype: "torch.dtype") -> "torch.Tensor":
    """A per-row value on every trained token of its row, 0 elsewhere."""
    import torch

    return torch.where(mask, seq_adv[:, None], torch.zeros((), dtype=seq_adv.dtype, device=mask.device)).to(dtype)


class _Chain(NamedTuple):
    """How the rows (segments) of each trajectory follow one another in time.

    ``succ`` ``[B]`` long: the row holding the next segment (with trained tokens) of the row's
    trajectory, -1 for a trajectory's last one. ``levels``: row indices by distance from their
    trajectory's end, last segments first, so a backward recursion can run level by level with
    every row's successor already done (one level when no trajectory has several segments).
    """

    succ: "torch.Tensor"
    levels: list["torch.Tensor"]


def _chain(owner: str, inputs: AdvantageInputs, rows: _Rows) -> _Chain:
    """Link the segments of each trajectory (rows sharing a ``sample_index``, in row order)."""
    import torch

    n_rows = rows.mask.shape[0]
    device = rows.mask.device
    if inputs.sample_index is None:
        return _Chain(torch.full((n_rows,), -1, dtype=torch.long, device=device),
                      [torch.arange(n_rows, device=device)])
    sample = _int_index(owner, "sample_index", inputs.sample_index, n_rows).tolist()
    has_tokens = rows.mask.any(dim=1).tolist()
    succ, depth, later = [-1] * n_rows, [0] * n_rows, {}
    for i in reversed(range(n_rows)):
        if not has_tokens[i]:  # a segment with nothing trained neither receives nor passes reward
            continue
        j = later.get(sample[i])
        if j is not None:
            succ[i], depth[i] = j, depth[j] + 1
        later[sample[i]] = i
    depth_t = torch.tensor(depth, dtype=torch.long, device=device)
    levels = [(depth_t == d).nonzero().flatten() for d in range(max(depth, default=0) + 1)]
    return _Chain(torch.tensor(succ, dtype=torch.long, device=device), levels)


def _from_successor(carry: "torch.Tensor", succ: "torch.Tensor") -> "torch.Tensor":
    """``carry`` of each row's successor, 0 where the row ends its trajectory."""
    import torch

    return torch.where(succ >= 0, carry[succ.clamp_min(0)], torch.zeros((), dtype=carry.dtype, device=carry.device))


def _token_rewards(owner: str, inputs: AdvantageInputs, rows: _Rows, chain: _Chain) -> "torch.Tensor":
    """Float64 ``[B, T]``: the score on the last trained token of each trajectory's last segment,
    plus masked ``token_rewards``."""
    import torch

    mask = rows.mask
    n_rows, width = mask.shape
    out = torch.zeros(n_rows, width, dtype=torch.float64, device=mask.device)
    has_tokens = mask.any(dim=1) & (chain.succ < 0)
    last = (width - 1) - mask.flip(1).to(torch.int8).argmax(dim=1)
    row_ids = torch.arange(n_rows, device=mask.device)[has_tokens]
    out[row_ids, last[has_tokens]] = rows.rewards[has_tokens]
    if inputs.token_rewards is not None:
        extra = chk.float_tensor2d(owner, "token_rewards", inputs.token_rewards, mask).to(torch.float64)
        if not torch.isfinite(extra[mask]).all():
            raise ValueError(f"{owner}: token_rewards hold NaN or inf on trained tokens")
        out = out + torch.where(mask, extra, torch.zeros((), dtype=torch.float64, device=mask.device))
    return out


def _active_columns(mask: "torch.Tensor") -> list[int]:
    """Columns holding at least one trained token, last first (the recursions skip the rest:
    prompt and padding columns change no state)."""
    return mask.any(dim=0).nonzero().flatten().flip(0).tolist()


def _row_returns(rewards: "torch.Tensor", mask: "torch.Tensor", gamma: float,
                 start: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """``G_t = r_t + gamma * G_next`` over the trained tokens of each row, where ``G_next`` after a
    row's last trained token is ``start``; also returns ``G`` at each row's first trained token
    (``start`` for a row with none)."""
    import torch

    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    if gamma == 1.0:  # plain suffix sums: no Python loop over T
        suffix = rewards.flip(1).cumsum(1).flip(1) + start[:, None]
        return torch.where(mask, suffix, zero), start + rewards.sum(dim=1)
    out = torch.zeros_like(rewards)
    running = start.clone()
    for t in _active_columns(mask):
        m = mask[:, t]
        running = torch.where(m, rewards[:, t] + gamma * running, running)
        out[:, t] = torch.where(m, running, zero)
    return out, running


def _discounted_returns(rewards: "torch.Tensor", mask: "torch.Tensor", gamma: float,
                        chain: _Chain) -> "torch.Tensor":
    """``G_t = r_t + gamma * G_next`` over the trained tokens of each trajectory (0 off the mask);
    a segment's last trained token continues from its next segment's first."""
    import torch

    out = torch.zeros_like(rewards)
    first = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for level in chain.levels:
        start = _from_successor(first, chain.succ[level])
        out[level], first[level] = _row_returns(rewards[level], mask[level], gamma, start)
    return out


def masked_whiten(values: "torch.Tensor", mask: "torch.Tensor", eps: float = 1e-8) -> "torch.Tensor":
    """``(x - mean) / sqrt(var + eps)`` with mean and (population) variance over ``mask``; 0 off it.

    When the selected values have no spread (or there are none) the result is all zeros, so equal
    returns never turn into noise.
    """
    import torch

    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    selected = values[mask]
    if selected.numel() == 0 or bool(selected.max() == selected.min()):
        return torch.zeros_like(values)
    mean = selected.mean()
    var = ((selected - mean) ** 2).mean()
    return torch.where(mask, (values - mean) * torch.rsqrt(var + eps), zero)


# ------------------------------------------------------------------------------------------------
# Estimators
# ------------------------------------------------------------------------------------------------


def grpo(inputs: AdvantageInputs, *, norm_std: bool = True, eps: float = 1e-6) -> AdvantageOutput:
    """GRPO: ``A_i = (r_i - mean_g) / (std_g + eps)`` (``std_g`` unbiased), or ``r_i - mean_g``
    when ``norm_std`` is false; broadcast onto the row's trained tokens."""
    owner = "grpo"
    norm_std = chk.flag(owner, "norm_std", norm_std)
    eps = chk.number(owner, "eps", eps, low=0.0)
    rows = _rows(owner, inputs)
    samples = _samples(owner, inputs, rows)
    stats = _group_stats(samples.group, samples.score)
    centred = samples.score - stats.mean
    if norm_std:
        centred = centred / (stats.std_unbiased + eps)
    import torch

    sample_adv = torch.where(stats.has_signal, centred, torch.zeros_like(centred))
    return AdvantageOutput(advantages=_broadcast(sample_adv[samples.inv], rows.mask, rows.dtype))


def dr_grpo(inputs: AdvantageInputs) -> AdvantageOutput:
    """Dr. GRPO: GRPO without the division by the group std, ``A_i = r_i - mean_g``."""
    return grpo(inputs, norm_std=False)


def rloo(inputs: AdvantageInputs) -> AdvantageOutput:
    """RLOO: ``A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean_g)`` for a group of n."""
    import torch

    owner = "rloo"
    rows = _rows(owner, inputs)
    samples = _samples(owner, inputs, rows)
    stats = _group_stats(samples.group, samples.score)
    scale = stats.count / (stats.count - 1).clamp_min(1)
    sample_adv = torch.where(stats.has_signal, (samples.score - stats.mean) * scale, torch.zeros_like(samples.score))
    return AdvantageOutput(advantages=_broadcast(sample_adv[samples.inv], rows.mask, rows.dtype))


def reinforce_pp(inputs: AdvantageInputs, *, gamma: float = 1.0, whiten: bool = True,
                 eps: float = 1e-8) -> AdvantageOutput:
    """REINFORCE++: discounted token returns ``G_t = r_t + gamma * G_{t+1}``, whitened over all
    trained tokens of the batch (``whiten``); ``returns`` holds the raw ``G_t``."""
    owner = "reinforce_pp"
    gamma = chk.number(owner, "gamma", gamma, low=0.0, high=1.0)
    whiten = chk.flag(owner, "whiten", whiten)
    eps = chk.number(owner, "eps", eps, low=0.0)
    rows = _rows(owner, inputs)
    chain = _chain(owner, inputs, rows)
    returns = _discounted_returns(_token_rewards(owner, inputs, rows, chain), rows.mask, gamma, chain)
    adv = masked_whiten(returns, rows.mask, eps) if whiten else returns
    return AdvantageOutput(advantages=adv.to(rows.dtype), returns=returns.to(rows.dtype))


def reinforce_pp_baseline(inputs: AdvantageInputs, *, whiten: bool = True, eps: float = 1e-8) -> AdvantageOutput:
    """REINFORCE++ with a group baseline: ``R_i`` (score plus the trajectory's summed
    ``token_rewards``) minus its group mean, broadcast onto tokens and whitened over the trained tokens of rows
    whose group has a signal; rows of groups without spread stay exactly 0."""
    import torch

    owner = "reinforce_pp_baseline"
    whiten = chk.flag(owner, "whiten", whiten)
    eps = chk.number(owner, "eps", eps, low=0.0)
    rows = _rows(owner, inputs)
    samples = _samples(owner, inputs, rows)
    stats = _group_stats(samples.group, samples.score)
    sample_adv = torch.where(stats.has_signal, samples.score - stats.mean, torch.zeros_like(samples.score))
    seq_adv = sample_adv[samples.inv]
    token_adv = torch.where(rows.mask, seq_adv[:, None], torch.zeros((), dtype=torch.float64, device=rows.mask.device))
    if whiten:
        token_adv = masked_whiten(token_adv, rows.mask & stats.has_signal[samples.inv][:, None], eps)
    return AdvantageOutput(advantages=token_adv.to(rows.dtype))


def gae(inputs: AdvantageInputs, *, gamma: float = 1.0, lam: float = 1.0, whiten: bool = True,
        eps: float = 1e-8) -> AdvantageOutput:
    """GAE: ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma * lam * A_{t+1}``
    over trained tokens (``V`` after the last trained token is 0); ``returns = A + V`` before the
    optional whitening of ``A``."""
    import torch

    owner = "gae"
    gamma = chk.number(owner, "gamma", gamma, low=0.0, high=1.0)
    lam = chk.number(owner, "lam", lam, low=0.0, high=1.0)
    whiten = chk.flag(owner, "whiten", whiten)
    eps = chk.number(owner, "eps", eps, low=0.0)
    rows = _rows(owner, inputs)
    if inputs.values is None:
        raise ValueError("gae: inputs.values is None; GAE needs critic values [B, T] (the spec sets "
                         "needs_critic=True so the host trains a critic and passes them)")
    mask = rows.mask
    values = chk.float_tensor2d(owner, "values", inputs.values, mask).to(torch.float64)
    if not torch.isfinite(values[mask]).all():
        raise ValueError("gae: values hold NaN or inf on trained tokens")
    zero = torch.zeros((), dtype=torch.float64, device=mask.device)
    values = torch.where(mask, values, zero)
    chain = _chain(owner, inputs, rows)
    rewards = _token_rewards(owner, inputs, rows, chain)
    adv = torch.zeros_like(rewards)
    # V and A at each row's first trained token: where the previous segment's recursion resumes
    first_value = torch.zeros(mask.shape[0], dtype=torch.float64, device=mask.device)
    first_adv = torch.zeros_like(first_value)
    for level in chain.levels:
        succ, m_level = chain.succ[level], mask[level]
        next_value = _from_successor(first_value, succ)
        next_adv = _from_successor(first_adv, succ)
        level_adv = torch.zeros_like(rewards[level])
        for t in _active_columns(m_level):
            m = m_level[:, t]
            delta = rewards[level, t] + gamma * next_value - values[level, t]
            a = delta + gamma * lam * next_adv
            level_adv[:, t] = torch.where(m, a, zero)
            next_adv = torch.where(m, a, next_adv)
            next_value = torch.where(m, values[level, t], next_value)
        adv[level], first_value[level], first_adv[level] = level_adv, next_value, next_adv
    returns = torch.where(mask, adv + values, zero)
    if whiten:
        adv = masked_whiten(adv, mask, eps)
    return AdvantageOutput(advantages=adv.to(rows.dtype), returns=returns.to(rows.dtype))
