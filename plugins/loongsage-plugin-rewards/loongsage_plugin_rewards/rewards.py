"""String and number rewards: ``exact_match``, ``token_f1``, ``numeric_match`` and ``format``.

Each takes the finished :class:`~loongsage_hookspecs.Trajectory` (its ``response_text`` and
``label``) plus keyword arguments from the job file's ``reward_args``, and returns a
:class:`~loongsage_hookspecs.Reward` whose ``details`` say whether an answer was found
(``parsed``) and whether it was right (``correct``).
"""

from __future__ import annotations

import functools
import math
import re
from fractions import Fraction
from typing import Any

from loongsage_hookspecs import Reward, Trajectory

from .extract import extract_final_answer, last_number, normalize_answer, parse_number


def _labels(label: Any) -> list[Any]:
    """A label, or a list of acceptable labels, as a list; a missing label is an error."""
    if label is None:
        raise ValueError("the trajectory has no label to compare with (is the data source's label_key right?)")
    if isinstance(label, (list, tuple)):
        if not label:
            raise ValueError("the trajectory's label is an empty list of acceptable answers")
        return list(label)
    return [label]


def exact_match(trajectory: Trajectory, *, case_sensitive: bool = False, extract: bool = True,
                score: float = 1.0) -> Reward:
    """``score`` when the response's final answer equals the label after normalisation, else 0.

    Args:
        case_sensitive: compare letters case-sensitively.
        extract: find the final answer (last ``\\boxed{}``, else text after "answer is"/"Answer:",
            else the whole response; see :mod:`.extract`); when false, the whole response is used.
        score: the reward for a match.

    A list label means "any of these". Details: ``correct`` (0/1) and ``parsed`` (1 when the
    answer was non-empty).
    """
    text = trajectory.response_text or ""
    answer = extract_final_answer(text) if extract else text.strip()
    got = normalize_answer(answer, case_sensitive=case_sensitive)
    correct = any(got == normalize_answer(str(lab), case_sensitive=case_sensitive)
                  for lab in _labels(trajectory.label))
    labels = ", ".join(repr(str(lab)) for lab in _labels(trajectory.label))
    reason = (f"answer {answer.strip()!r} matches the label" if correct else
              f"answer {answer.strip()!r} is not {labels}" if got else "no answer found in the response")
    return Reward(score=float(score) if correct else 0.0,
                  details={"correct": float(correct), "parsed": float(bool(got))}, reason=reason)


def _label_number(label: Any) -> Fraction | float:
    if isinstance(label, bool):
        raise ValueError(f"numeric_match: label {label!r} is not a number")
    if isinstance(label, (int, float)):
        return Fraction(label) if isinstance(label, int) or math.isfinite(label) else float(label)
    value = parse_number(str(label))
    if value is None:
        value = last_number(str(label))
    if value is None:
        raise ValueError(f"numeric_match: label {label!r} has no number in it")
    return value


def numeric_match(trajectory: Trajectory, *, tolerance: float = 1e-6, rel_tolerance: float = 0.0,
                  score: float = 1.0) -> Reward:
    """``score`` when the last number of the final answer is within tolerance of the label.

    Args:
        tolerance: absolute tolerance; ``|answer - label| <= tolerance`` counts as correct.
        rel_tolerance: relative tolerance; also correct when ``|answer - label| <= rel_tolerance * |label|``.
        score: the reward for a match.

    The answer is the last number (integers, decimals, ``1,000``, ``3/4``, ``1e-3``) of the
    extracted final answer (see :mod:`.extract`), or of the whole response when that has none.
    A list label means "any of these". Details: ``correct``, ``parsed`` (a number was found).
    """
    if tolerance < 0 or rel_tolerance < 0:
        raise ValueError(f"numeric_match: tolerances must be >= 0, got tolerance={tolerance} "
                         f"rel_tolerance={rel_tolerance}")
    text = trajectory.response_text or ""
    value = last_number(extract_final_answer(text))
    if value is None:
        value = last_number(text)
    targets = [_label_number(lab) for lab in _labels(trajectory.label)]
    correct = False
    if value is not None:
        for target in targets:
            diff = abs(value - target) if isinstance(value, Fraction) and isinstance(target, Fraction) \
                else abs(float(value) - float(target))
            if diff <= tolerance or diff <= rel_tolerance * abs(float(target)):
                correct = True
                break
    shown = ", ".join(str(t) for t in targets)
    reason = (f"answer {value} matches the label" if correct else
              f"answer {value} is not {shown}" if value is not None else "no number found in the response")
    return Reward(score=float(score) if correct else 0.0,
                  details={"correct": float(correct), "parsed": float(value is not None)}, reason=reason)


@functools.lru_cache(maxsize=256)
def _compile(pattern: str, ignore_case: bool) -> re.Pattern[str]:
    try:
        return re.compile(pattern, re.DOTALL | (re.IGNORECASE if ignore_case else 0))
    except re.error as exc:
        raise ValueError(f"format: invalid regex 'pattern' {pattern!r}: {exc}") from None


def format_reward(trajectory: Trajectory, *, pattern: str, mode: str = "search", ignore_case: bool = False,
                  score: float = 1.0) -> Reward:
    """``score`` when the response matches the regular expression ``pattern``, else 0.

    Args:
        pattern: a Python regular expression (compiled with ``re.DOTALL``: ``.`` spans lines).
        mode: ``"search"`` (anywhere), ``"match"`` (at the start) or ``"fullmatch"`` (the whole
            response, after stripping surrounding whitespace).
        ignore_case: compile with ``re.IGNORECASE``.
        score: the reward for a match.

    Details: ``matched`` (0/1).
    """
    if mode not in ("search", "match", "fullmatch"):
        raise ValueError(f"format: 'mode' must be 'search', 'match' or 'fullmatch', got {mode!r}")
    regex = _compile(pattern, bool(ignore_case))
    text = trajectory.response_text or ""
    if mode == "fullmatch":
        text = text.strip()
    matched = getattr(regex, mode)(text) is not None
    reason = f"{'matches' if matched else 'does not match'} {pattern!r} ({mode})"
    return Reward(score=float(score) if matched else 0.0, details={"matched": float(matched)}, reason=reason)


_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCT_RE = re.compile(r"[^\w\s]")


def answer_tokens(text: str) -> list[str]:
    """The words of an answer as SQuAD's F1 counts them: lower-cased, punctuation and the
    articles ``a``/``an``/``the`` removed, split on whitespace."""
    text = _PUNCT_RE.sub(" ", str(text).casefold())
    return _ARTICLES_RE.sub(" ", text).split()


def f1_score(prediction: str, reference: str) -> float:
    """Token-overlap F1 of two answers (SQuAD's definition): the harmonic mean of the share of the
    prediction's words found in the reference and the share of the reference's words found in
    the prediction, each word counted as often as it occurs in both. Two empty answers score 1."""
    pred, ref = answer_tokens(prediction), answer_tokens(reference)
    if not pred or not ref:
        return float(pred == ref)
    common = sum(min(pred.count(w), ref.count(w)) for w in set(pred))
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def token_f1(trajectory: Trajectory, *, extract: bool = True, score: float = 1.0) -> Reward:
    """``score`` times the best token-overlap F1 between the final answer and the label(s).

    Args:
        extract: find the final answer first (see :mod:`.extract`); when false, the whole response.
        score: the reward of a perfect overlap.

    Partial credit for answers that are close but not equal (``"Kazal"`` against
    ``"Kazal Motors"`` scores 0.67). A list label means "any of these" (the best F1 counts).
    Details: ``f1`` (the best F1), ``exact`` (1 when the normalised words are equal), ``parsed``.
    """
    text = trajectory.response_text or ""
    answer = extract_final_answer(text) if extract else text.strip()
    labels = [str(lab) for lab in _labels(trajectory.label)]
    best = max(f1_score(answer, lab) for lab in labels)
    exact = any(answer_tokens(answer) == answer_tokens(lab) for lab in labels)
    reason = (f"answer {answer.strip()!r}: F1 {best:.2f} against " + ", ".join(repr(lab) for lab in labels)
              if answer.strip() else "no answer found in the response")
    return Reward(score=float(score) * best, details={"f1": best, "exact": float(exact),
                                                      "parsed": float(bool(answer.strip()))}, reason=reason)
