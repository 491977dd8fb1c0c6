"""Grammar-constrained decoding that engines and trainers compute alike (see :mod:`loongsage_core.grammar`)."""

from __future__ import annotations

from ..grammar import KINDS, GrammarError, TokenGrammar, allowed_sets, compile_grammar, mask_logits, token_grammar

__all__ = ["KINDS", "GrammarError", "TokenGrammar", "allowed_sets", "compile_grammar", "mask_logits",
           "token_grammar"]
