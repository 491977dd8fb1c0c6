"""Pulling the final answer out of a model response, and normalising answers for comparison.

The rules (used by ``exact_match``, ``numeric_match``, ``math_verify``'s fallback and ``countdown``):

1. Reasoning is dropped: if the response contains ``</think>``, only the text after the last one
   is kept.
2. The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced, is the answer.
3. Else the text after the last ``answer is`` or ``Answer:`` (case-insensitive), up to the end
   of that line, with a trailing period removed.
4. Else the whole stripped response.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_RE = re.compile(r"(?:answer\s+is|answer\s*:)\s*:?", re.IGNORECASE)
_NUMBER_RE = re.compile(r"(?<![\w.])[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")


def strip_reasoning(response: str) -> str:
    """The part of ``response`` after the last ``</think>`` (all of it when there is none)."""
    head, sep, tail = response.rpartition("</think>")
    return tail if sep else response


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` in ``text`` with balanced braces, or None."""
    matches = list(_BOX_RE.finditer(text))
    for match in reversed(matches):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def extract_final_answer(response: str) -> str:
    """The final answer in ``response`` by the module's rules (boxed, then "answer is", then all)."""
    text = strip_reasoning(response or "")
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    matches = list(_ANSWER_RE.finditer(text))
    if matches:
        rest = text[matches[-1].end():].strip()
        line = rest.splitlines()[0].strip() if rest else ""
        return line[:-1].rstrip() if line.endswith(".") else line
    return text.strip()


def normalize_answer(answer: str, *, case_sensitive: bool = False) -> str:
    """Canonical text of an answer, so cosmetic differences do not fail an exact match.

    Removes surrounding ``$``, a trailing period, ``\\text{..}``-style wrappers (keeping their
    content) and thousands separators inside numbers (``1,000`` -> ``1000``); collapses runs of
    whitespace; lower-cases unless ``case_sensitive``.
    """
    text = str(answer).strip()
    while len(text) >= 2 and text[0] == "$" and text[-1] == "$":
        text = text[1:-1].strip()
    text = _TEXT_RE.sub(r"\1", text)
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    text = text.rstrip(".").strip()
    text = " ".join(text.split())
    return text if case_sensitive else text.casefold()


def parse_number(text: str) -> Fraction | float | None:
    """The number written in ``text`` (an int, decimal, ``1e-3``, ``1,000`` or ``a/b``), or None.

    Exact values come back as :class:`~fractions.Fraction`; only values too large for that, or
    written in scientific notation, as float.
    """
    raw = text.strip().replace("−", "-").replace(",", "").replace(" ", "")
    if not raw:
        return None
    try:
        if "/" in raw:
            num, den = raw.split("/", 1)
            return Fraction(int(num), int(den)) if int(den) != 0 else None
        if "e" in raw.lower():
            return float(raw)
        return Fraction(raw)
    except (ValueError, ZeroDivisionError):
        return None


def last_number(text: str) -> Fraction | float | None:
    """The last number written anywhere in ``text`` (see :func:`parse_number`), or None."""
    for match in reversed(list(_NUMBER_RE.finditer(text or ""))):
        value = parse_number(match.group(0))
        if value is not None:
            return value
    return None
