"""Speculative decoding for the embedded engine: prompt-lookup drafts, verified exactly.

Drafting (:class:`PromptLookup`) needs no second model: the last ``ngram`` tokens of a sequence
are looked up among its own earlier tokens (prompt and output so far), and the up to
``num_draft`` tokens that followed their latest earlier occurrence are the draft (a copy that
reaches the sequence's end goes on into the draft, as a repeating span would). A request
that copies from its context (an edited file echoed back, a quoted document, a repeated tool
call) gets long drafts that the model accepts; text with no match gets none and decodes as usual.
Each request keeps an index from n-gram to its latest end position, extended by the tokens
appended since the last step, so a lookup costs the same however long the context.

Verification (:func:`verify_drafts`) runs on the target model's logits at the drafted positions,
all computed in one forward (the scheduler feeds the last token and the drafts together). The
draft is a point mass ``q = delta(x)``, so the speculative-sampling rule (Leviathan et al. 2023,
Chen et al. 2023) reads: accept ``x`` with probability ``p(x)``, where ``p`` is the request's
sampling distribution (temperature, top-k, top-p, min-p, :func:`~.sampling.sampling_probs`); on
the first rejection draw from the residual ``max(p - q, 0)`` normalised, that is ``p`` without
``x``, and stop; when every draft is accepted draw one more token from the next position's ``p``.
Each emitted token is then distributed exactly as the non-speculative sampler's: speculation
changes how many forwards a sequence costs, not which sequences the policy produces. A greedy
request accepts a draft iff it is the arg-max and otherwise emits the arg-max, the tokens of plain
greedy decoding.

The log-prob reported for every emitted token is ``log_softmax(raw logits)[token]`` at its
position, the quantity the non-speculative path reports (see :mod:`.sampling`), so the trainer's
importance ratios and ``train/is_approx_k3_kl`` see the same numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .sampling import SamplingParams, draw, sampling_probs
from .settings import SpeculativeSettings

if TYPE_CHECKING:  # pragma: no cover
    import torch


class PromptLookup:
    """Drafts from a sequence's own context by n-gram match (see the module docstring)."""

    def __init__(self, settings: SpeculativeSettings) -> None:
        self.num_draft = settings.num_draft
        self.ngram = settings.ngram

    def propose(self, tokens: list[int], index: dict[tuple[int, ...], int], indexed: int,
                limit: int) -> tuple[list[int], int]:
        """Up to ``min(num_draft, limit)`` draft tokens to follow ``tokens``.

        ``index`` maps each n-gram of ``tokens`` to the position right after its latest
        occurrence; it covers the n-grams ending before position ``indexed`` and is brought up to
        date here (the n-gram that ends the sequence is left out, so a match is an earlier one).
        Returns the draft and the new ``indexed``.
        """
        n, length = self.ngram, len(tokens)
        for end in range(max(indexed, n), length):
            index[tuple(tokens[end - n: end])] = end
        indexed = max(indexed, length)
        if limit <= 0 or length <= n:
            return [], indexed
        start = index.get(tuple(tokens[length - n:]))
        if start is None:
            return [], indexed
        # the copy continues past the sequence's end into the draft itself, so a repeating span
        # (period length - start) drafts num_draft tokens however short it is
        draft: list[int] = []
        for pos in range(start, start + min(self.num_draft, limit)):
            draft.append(tokens[pos] if pos < length else draft[pos - length])
        return draft, indexed


def verify_drafts(logits: "torch.Tensor", drafts: list[int], params: SamplingParams,
                  generator: Any) -> list[int]:
    """The tokens one request emits from the target's logits ``[len(drafts) + 1, V]`` (row ``i``
    predicts the token after draft ``i - 1``, row 0 the token after the sequence): the accepted
    drafts and then one token, a correction at the first rejection or the bonus token after the
    last row. ``generator`` is the request's random stream (unused when greedy)."""
    if params.greedy:
        best = logits.argmax(dim=-1).tolist()
        out: list[int] = []
        for i, draft in enumerate(drafts):
            out.append(best[i])
            if best[i] != draft:
                return out
        out.append(best[len(drafts)])
        return out
    import torch

    probs = sampling_probs(logits, params)
    out = []
    for i, draft in enumerate(drafts):
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u < float(probs[i, draft]):
            out.append(draft)
            continue
        residual = probs[i].clone()
        residual[draft] = 0.0
        out.append(draw(residual, generator))
        return out
    out.append(draw(probs[len(drafts)], generator))
    return out
