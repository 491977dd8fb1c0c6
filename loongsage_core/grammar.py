"""Grammar-constrained decoding that engines and trainers agree on, token for token (llguidance).

A constrained turn (a forced tool call, structured output) is sampled from the policy's
distribution restricted, at every step, to the tokens its grammar allows there. Its log-probs are
therefore those of the restricted distribution, and a trainer that scores the same tokens without
the restriction computes other numbers: the importance ratio and ``train/is_approx_k3_kl`` of a
constrained turn would measure the constraint, not the policy change. So the engine and the
trainer compute the allowed set with the same code, from the same grammar:

* :func:`compile_grammar` turns a request's constraint (SGLang's ``json_schema``, ``regex`` or
  ``ebnf`` sampling parameters; ``ebnf`` takes a Lark grammar in llguidance's syntax or GBNF) into
  llguidance's serialized grammar, which the router keeps in the record
  (:class:`~loongsage_hookspecs.GrammarSpan`);
* :class:`TokenGrammar` wraps a Hugging Face tokenizer for a vocabulary of ``vocab_size`` logits;
  :meth:`TokenGrammar.allowed` is the allowed set of one decoding step and
  :meth:`TokenGrammar.replay` the allowed sets of a recorded span, step by step;
* :func:`mask_logits` applies allowed sets to logits, and :func:`allowed_sets` gives a trainer the
  allowed sets of a batch's constrained spans (``Batch.meta["constraints"]``).

The turn's stop tokens (the chat template's turn end) are allowed exactly where the grammar may
end, and llguidance's own end-of-sequence token only as one of them: the engine stops a turn on
its stop tokens, whatever the tokenizer calls its EOS.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any, Iterable, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch

KINDS = ("json_schema", "regex", "ebnf")
"""The constraint kinds of SGLang's ``sampling_params`` (one per request)."""


class GrammarError(ValueError):
    """A constraint that does not compile (the message says why)."""


def compile_grammar(kind: str, text: str) -> str:
    """llguidance's serialized grammar for a constraint of ``kind`` (:data:`KINDS`) given as ``text``."""
    import llguidance

    if kind not in KINDS:
        raise GrammarError(f"unknown constraint kind {kind!r}; choose one of {', '.join(KINDS)}")
    if not isinstance(text, str) or not text.strip():
        raise GrammarError(f"'{kind}' must be a non-empty string")
    try:
        if kind == "json_schema":
            json.loads(text)
            return str(llguidance.LLMatcher.grammar_from_json_schema(text))
        if kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(text))
        return str(llguidance.grammar_from("grammar", text))
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"'{kind}' does not compile: {exc}") from None


def lark_string(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


class TokenGrammar:
    """A tokenizer as llguidance sees it, for logits over ``vocab_size`` tokens.

    Building one costs about a second for a large vocabulary; keep it (:func:`token_grammar`).
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        import llguidance.hf

        self.vocab_size = int(vocab_size)
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=self.vocab_size)
        self.eos_id = int(getattr(self.tokenizer, "eos_token", -1))
        added = hf_tokenizer.get_added_vocab() if hasattr(hf_tokenizer, "get_added_vocab") else {}
        #: added tokens llguidance treats as special (matched by id, never as their text)
        self.special = {text: int(i) for text, i in added.items()
                        if i < self.vocab_size and self.tokenizer.is_special_token(int(i))}

    def literal(self, text: str) -> str:
        """A Lark expression for ``text``: its special tokens (``<tool_call>`` in some tokenizers)
        referenced by id, the rest as string literals."""
        parts: list[str] = []
        rest = text
        while rest:
            hits = [(rest.find(s), -len(s), s) for s in self.special if s and rest.find(s) >= 0]
            if not hits:
                parts.append(lark_string(rest))
                break
            at, _, special = min(hits)
            if at:
                parts.append(lark_string(rest[:at]))
            parts.append(f"<[{self.special[special]}]>")
            rest = rest[at + len(special):]
        return " ".join(parts) if parts else '""'

    def check(self, grammar: str) -> None:
        """Raise :class:`GrammarError` when ``grammar`` cannot constrain this tokenizer."""
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(error)

    def matcher(self, grammar: str) -> Any:
        """A fresh llguidance matcher of ``grammar`` at its start."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def allowed(self, matcher: Any, stop_token_ids: Iterable[int]) -> "torch.Tensor":
        """The tokens ``matcher`` allows next, bool ``[vocab_size]``: the grammar's tokens, and the
        stop tokens where the grammar may end (also when it allows nothing at all, so a turn
        whose grammar failed still ends)."""
        import llguidance.torch as lt
        import torch

        bitmask = lt.allocate_token_bitmask(1, self.vocab_size)
        lt.fill_next_token_bitmask(matcher, bitmask, 0)
        bits = ((bitmask[0].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten()
        allowed = bits[: self.vocab_size].clone()
        if 0 <= self.eos_id < self.vocab_size:
            allowed[self.eos_id] = False
        stops = [t for t in stop_token_ids if 0 <= t < self.vocab_size]
        if stops and (matcher.is_accepting() or matcher.is_stopped() or not bool(allowed.any())):
            allowed[stops] = True
        return allowed

    @staticmethod
    def advance(matcher: Any, token: int, stop_token_ids: Sequence[int]) -> None:
        """Feed one sampled token to ``matcher`` (a stop token ends the turn and is not fed)."""
        if token not in stop_token_ids and not matcher.is_stopped():
            matcher.consume_token(int(token))

    def replay(self, grammar: str, tokens: Sequence[int], stop_token_ids: Sequence[int]) -> "torch.Tensor":
        """The allowed set before each of ``tokens`` (sampled under ``grammar`` from its start),
        bool ``[len(tokens), vocab_size]``: what the engine masked at each step."""
        import torch

        matcher = self.matcher(grammar)
        stops = list(stop_token_ids)
        rows = []
        for token in tokens:
            rows.append(self.allowed(matcher, stops))
            self.advance(matcher, int(token), stops)
        if not rows:
            return torch.zeros((0, self.vocab_size), dtype=torch.bool)
        return torch.stack(rows)


@functools.lru_cache(maxsize=8)
def token_grammar(hf_tokenizer: Any, vocab_size: int) -> TokenGrammar:
    """The :class:`TokenGrammar` of ``hf_tokenizer`` for ``vocab_size`` logits, built once per tokenizer."""
    return TokenGrammar(hf_tokenizer, vocab_size)


def allowed_sets(hf_tokenizer: Any, vocab_size: int, ids: "torch.Tensor", spans: Sequence[Any],
                 rows: "torch.Tensor", cols: "torch.Tensor") -> "torch.Tensor | None":
    """A trainer's view of a batch's constrained spans (``meta["constraints"]``: per row, ``(start,
    end, grammar, stop_token_ids)``) at the tokens ``ids[rows, cols]`` (``ids`` ``[b, T]``) its
    logits predict. Bool ``[K, vocab_size]``: the tokens the engine allowed when it sampled
    ``ids[rows[k], cols[k]]`` (every token outside a constrained span), or ``None`` when no
    position is in a span."""
    import torch

    where = {(r, c): k for k, (r, c) in enumerate(zip(rows.tolist(), cols.tolist()))}
    grammar = token_grammar(hf_tokenizer, vocab_size)
    allowed: torch.Tensor | None = None
    for r, row_spans in enumerate(spans):
        for start, end, text, stops in row_spans or ():
            hits = [(j, where[(r, c)]) for j, c in enumerate(range(start, end)) if (r, c) in where]
            if not hits:
                continue
            masks = grammar.replay(text, ids[r, start:end].tolist(), list(stops))
            if allowed is None:
                allowed = torch.ones((int(rows.shape[0]), vocab_size), dtype=torch.bool)
            steps = torch.tensor([j for j, _ in hits])
            allowed[torch.tensor([k for _, k in hits])] = masks[steps]
    return allowed


def mask_logits(logits: "torch.Tensor", allowed: "torch.Tensor") -> "torch.Tensor":
    """``logits`` ``[..., V]`` with every token ``allowed`` (bool, same shape) does not hold set to
    the lowest float (not ``-inf``: a softmax-weighted sum over it, an entropy, stays finite)."""
    import torch

    return logits.masked_fill(~allowed.to(logits.device), torch.finfo(logits.dtype).min)


__all__ = ["KINDS", "GrammarError", "TokenGrammar", "allowed_sets", "compile_grammar", "lark_string", "mask_logits",
           "token_grammar"]
