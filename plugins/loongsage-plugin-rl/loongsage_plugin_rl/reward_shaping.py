"""Reward wrappers: ``fn(trajectory, **args) -> Reward``, summed by the host with the other
rewards a data source lists."""

from __future__ import annotations

from loongsage_hookspecs import Reward, Trajectory

from . import _checks as chk


def overlong_penalty(trajectory: Trajectory, *, max_len: int, cache_len: int, factor: float = 1.0) -> Reward:
    """DAPO soft overlong punishment on the generated length ``L`` (``trajectory.response_length``).

    ``0`` while ``L <= max_len - cache_len``, then a linear ramp ``(max_len - cache_len - L) /
    cache_len`` down to ``-1`` at ``L = max_len``, and ``-1`` beyond; the result is scaled by
    ``factor``. ``cache_len = 0`` gives the hard version (0, then -1 past ``max_len``).
    """
    owner = "overlong_penalty"
    if not isinstance(trajectory, Trajectory):
        raise TypeError(f"{owner}: expected a Trajectory, got {type(trajectory).__name__}")
    for name, value in (("max_len", max_len), ("cache_len", cache_len)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{owner}: argument {name!r} must be an integer, got {value!r}")
    if max_len <= 0:
        raise ValueError(f"{owner}: argument 'max_len' must be > 0, got {max_len}")
    if not 0 <= cache_len <= max_len:
        raise ValueError(f"{owner}: argument 'cache_len' must be in [0, max_len={max_len}], got {cache_len}")
    factor = chk.number(owner, "factor", factor, low=0.0)
    length = trajectory.response_length
    start = max_len - cache_len
    if length <= start:
        penalty = 0.0
    elif length <= max_len:
        penalty = (start - length) / cache_len
    else:
        penalty = -1.0
    score = factor * penalty
    return Reward(score=score, details={"overlong_penalty": score})
