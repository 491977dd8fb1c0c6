"""Scoring constrained turns the way the engine sampled them: the grammar replayed over the tokens.

A turn decoded under a grammar (a forced tool call, structured output) was sampled from the
policy restricted to the tokens the grammar allowed at each step, and the engine reported the
log-probs of that restricted distribution. The batch lists those spans (``meta["constraints"]``,
see :class:`~loongsage_hookspecs.GrammarSpan`); :class:`GrammarReplay` recomputes each step's
allowed set from the span's tokens with the engine's own code
(:mod:`loongsage_core.backend_api.grammar`) and masks the trainer's logits the same way, so the
trainer's log-probs, the importance ratios and the KL estimates compare like with like.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from loongsage_core.backend_api.grammar import allowed_sets, mask_logits

LogitFilter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(logits [K, V], rows [K], cols [K]) -> logits``: logits predicting tokens ``ids[rows, cols]``."""


class GrammarReplay:
    """Masks a micro-batch's logits at its constrained spans (the tokenizer is loaded on first use)."""

    def __init__(self, load_tokenizer: Callable[[], Any]) -> None:
        self._load_tokenizer = load_tokenizer
        self._tokenizer: Any = None

    def filter_for(self, meta: dict[str, list[Any]], input_ids: torch.Tensor) -> LogitFilter | None:
        """The logit filter of a micro-batch (its ``meta`` and ``input_ids`` ``[b, T]``), or ``None``
        when none of its rows holds a constrained span."""
        spans = meta.get("constraints")
        if not spans or not any(spans):
            return None
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        tokenizer = self._tokenizer
        ids = input_ids.detach().cpu()

        def constrain(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
            allowed = allowed_sets(tokenizer, logits.shape[-1], ids, spans, rows, cols)
            return logits if allowed is None else mask_logits(logits, allowed)

        return constrain


def padded_positions(scored: torch.Tensor | None, shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(rows, cols)`` of the tokens next-token logits predict, in their order: the ``scored``
    tokens (bool ``[b, T]``) past each row's first, or every token past the first of ``shape``."""
    if scored is not None:
        rows, before = scored[:, 1:].nonzero(as_tuple=True)
        return rows, before + 1
    b, t = shape
    rows = torch.arange(b).repeat_interleave(t - 1)
    cols = torch.arange(1, t).repeat(b)
    return rows, cols
