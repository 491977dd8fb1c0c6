"""The ``math_verify`` reward: mathematical equivalence of the final answer and the label.

Two back ends, chosen by the ``backend`` argument:

* ``"math_verify"``: the `math-verify` package (a dependency of this plugin) parses LaTeX and
  plain expressions from the response and the label and checks them for equivalence with
  sympy (``\\frac{1}{2}`` equals ``0.5``, ``x+1`` equals ``1+x``, sets and intervals, ...).
  Its timeouts use ``signal.alarm``, which only works on the main thread: off the main thread
  they are disabled, and the ``timeout_s`` argument applies on the main thread only.
* ``"simple"``: a sympy-free check. The final answer is extracted (see :mod:`.extract`), both
  sides are normalised (``\\left``/``\\right``, ``\\dfrac``/``\\tfrac``, ``\\frac{a}{b}`` to
  ``a/b``, ``^\\circ``, ``\\%``, ``\\$``, ``\\!``, spaces, then :func:`.extract.normalize_answer`)
  and compared as exact rational numbers when both are numbers, else as strings.

``"auto"`` (the default) uses ``math_verify`` when it is importable, else ``simple``.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from loongsage_hookspecs import Reward, Trajectory

from .extract import extract_final_answer, normalize_answer, parse_number

_FRAC_RE = re.compile(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")


def _latex_to_plain(text: str) -> str:
    """Light LaTeX clean-up so that equal answers written differently compare equal."""
    text = text.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = text.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\%", "").replace("\\$", "")
    previous = None
    while previous != text:
        previous = text
        text = _FRAC_RE.sub(lambda m: f"({m.group(1)})/({m.group(2)})", text)
    text = text.replace(" ", "")
    text = re.sub(r"^\((-?[\d.]+)\)/\((-?[\d.]+)\)$", r"\1/\2", text)
    return text


def simple_equivalent(answer: str, label: str) -> bool:
    """The sympy-free check: equal as numbers (exactly), else equal as normalised strings."""
    a = normalize_answer(_latex_to_plain(answer))
    b = normalize_answer(_latex_to_plain(label))
    na, nb = parse_number(a), parse_number(b)
    if na is not None and nb is not None:
        return abs(float(na) - float(nb)) <= 1e-9 * max(1.0, abs(float(nb))) if isinstance(na, float) \
            or isinstance(nb, float) else na == nb
    return a == b


def _math_verify_equivalent(response: str, label: str, timeout_s: int | None) -> tuple[bool, bool]:
    from math_verify import parse, verify

    if threading.current_thread() is not threading.main_thread():
        timeout_s = None
    gold = parse(label, parsing_timeout=timeout_s)
    if not gold:
        gold = parse(f"${label}$", parsing_timeout=timeout_s)
    if not gold:
        raise ValueError(f"math_verify: cannot parse the label {label!r} as a mathematical answer")
    pred = parse(response, parsing_timeout=timeout_s)
    if not pred:
        return False, False
    return bool(verify(gold, pred, timeout_seconds=timeout_s)), True


def _have_math_verify() -> bool:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def math_verify_reward(trajectory: Trajectory, *, backend: str = "auto", timeout_s: int = 5,
                       score: float = 1.0) -> Reward:
    """``score`` when the response's answer is mathematically equal to the label, else 0.

    Args:
        backend: ``"auto"``, ``"math_verify"`` or ``"simple"`` (see the module docstring).
        timeout_s: per-parse/verify time limit of the ``math_verify`` back end (main thread only).
        score: the reward for a correct answer.

    A list label means "any of these". Details: ``correct``, ``parsed`` (an answer was found).
    """
    if backend not in ("auto", "math_verify", "simple"):
        raise ValueError(f"math_verify: 'backend' must be 'auto', 'math_verify' or 'simple', got {backend!r}")
    if trajectory.label is None:
        raise ValueError("math_verify: the trajectory has no label to compare with")
    labels: list[Any] = list(trajectory.label) if isinstance(trajectory.label, (list, tuple)) else [trajectory.label]
    use_mv = backend == "math_verify" or (backend == "auto" and _have_math_verify())
    text = trajectory.response_text or ""
    correct = parsed = False
    for label in labels:
        if use_mv:
            # math-verify finds the answer itself (boxed first, then the last expression);
            # reasoning before </think> is dropped so an intermediate result is not taken.
            ok, found = _math_verify_equivalent(text.rpartition("</think>")[2], str(label), timeout_s)
        else:
            answer = extract_final_answer(text)
            ok, found = simple_equivalent(answer, str(label)), bool(answer)
        correct, parsed = correct or ok, parsed or found
        if correct:
            break
    how = "math-verify" if use_mv else "simple comparison"
    reason = (f"equivalent to the label ({how})" if correct else
              f"answer not equivalent to {', '.join(repr(str(lab)) for lab in labels)} ({how})" if parsed
              else "no answer found in the response")
    return Reward(score=float(score) if correct else 0.0,
                  details={"correct": float(correct), "parsed": float(parsed)}, reason=reason)
