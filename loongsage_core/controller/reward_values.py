"""What a reward function may return, checked per trajectory.

A reward's score becomes an advantage, and one ``nan``, ``inf`` or ``1e308`` in a group turns
every advantage of the group (and, through the loss, the whole step) into garbage; a ``None``,
``'yes'`` or ``[1.0]`` cannot be summed at all. Such a value is the reward's fault, not the run's:
it fails that one trajectory with the reward's name and the value, exactly as a reward that
raises does, and the run goes on.

A score (and every number in a :class:`~loongsage_hookspecs.Reward`'s ``details``) must be a real
number (``bool``, ``int``, ``float``, a NumPy scalar, a one-element tensor: anything with
``__float__`` that is not text), finite, with ``|x| <= MAX_ABS_REWARD`` (``1e6``): rewards are
normalised per group by most estimators, but a score that large is a bug (a count of tokens, a
raw log-likelihood sum) rather than a reward, and squared in a standard deviation it is within a
few orders of magnitude of float32's range.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

from loongsage_hookspecs import Reward

MAX_ABS_REWARD = 1e6
"""The largest magnitude a reward score or detail may have."""


class RewardValueError(ValueError):
    """A reward function returned something that is not a usable score; the message says which
    reward and what it returned."""


def checked_score(name: str, value: Any) -> float:
    """``value`` as a float if it is a usable reward number, else :class:`RewardValueError`
    naming ``name`` (the reward, or ``reward/detail``) and the value."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise RewardValueError(f"reward '{name}' returned {_shown(value)} ({type(value).__name__}), "
                               "not a number")
    try:
        number = float(value)
    except (TypeError, ValueError) as exc:  # e.g. a tensor of several elements
        raise RewardValueError(f"reward '{name}' returned {_shown(value)} ({type(value).__name__}), "
                               f"not one number: {exc}") from None
    if not math.isfinite(number) or abs(number) > MAX_ABS_REWARD:
        raise RewardValueError(f"reward '{name}' returned {number!r}: a score must be finite with "
                               f"|score| <= {MAX_ABS_REWARD:g}")
    return number


def checked_reward(name: str, out: Any) -> Reward:
    """A reward function's return value (a number or a :class:`Reward`) as a :class:`Reward`
    whose score and details are checked floats (:func:`checked_score`)."""
    if not isinstance(out, Reward):
        return Reward(score=checked_score(name, out))
    out.score = checked_score(name, out.score)
    if not isinstance(out.details, dict):
        raise RewardValueError(f"reward '{name}' returned details {_shown(out.details)}, not a dict")
    out.details = {str(k): checked_score(f"{name}/{k}", v) for k, v in out.details.items()}
    return out


def reward_failure(name: str, exc: Exception) -> str:
    """The one-line error a trajectory records when reward ``name`` raised ``exc`` or returned an
    unusable value (:class:`RewardValueError`, whose message already says which and what)."""
    if isinstance(exc, RewardValueError):
        return str(exc)
    return f"reward '{name}' raised {type(exc).__name__}: {exc}"


def _shown(value: Any) -> str:
    """A short repr of ``value`` (:mod:`reprlib`: a reward may return anything, of any size)."""
    try:
        return reprlib.repr(value)
    except Exception as exc:  # a user object whose repr raises
        return f"<unprintable {type(value).__name__}: {type(exc).__name__}>"
