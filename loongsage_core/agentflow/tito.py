"""Token-in, token-out: rendering a growing chat to tokens without re-tokenizing model output.

The first request of a segment is rendered with the chat template (tools and generation prompt
included) and tokenized once. After the model answered, its exact output tokens stay in the
record. A later request that extends the conversation is turned into a *delta*: only the text the
template puts after the recorded assistant turn (the rest of that turn's closing, e.g. the
``"\\n"`` after ``<|im_end|>``, then the new messages and the next generation prompt) is tokenized
and appended. Model-generated tokens are never decoded and re-encoded.

How the delta is found:

1. ``prev`` = template(recorded messages), ``full`` = template(recorded + new, generation prompt).
   When ``full`` starts with ``prev`` the body is ``full[len(prev):]``.
2. Templates that restyle history once a new message arrives (e.g. dropping earlier reasoning)
   break step 1; then the new messages are rendered after a fixed anchor conversation (system
   message and tools kept, one user and one assistant message) and the body is the text after
   the anchor.
3. The closing: the template ends the assistant turn with a turn-end token (``<|im_end|>``,
   ``<|eot_id|>``, ...) and maybe more text. If the model's output ended with a turn-end token,
   the closing is the template text after the last turn-end in ``prev``; if the output was cut
   (length limit, stop string) the closing also includes that turn-end token itself.

The delta text starts right after a special token (or is the closing itself), so tokenizing it
alone gives the same ids as tokenizing it in context for templates built from special-token
delimiters (ChatML/Qwen, Llama 3, Mistral).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from .messages import template_message

TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>")
"""Special tokens that end an assistant turn in common chat templates (used when present in the vocabulary)."""

_ANCHOR = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]


class TemplateError(ValueError):
    """The chat template cannot render a request (the message comes from the template)."""


def turn_end_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokens that end a model turn: the tokenizer's EOS token, then every token of
    :data:`TURN_END_TOKENS` its vocabulary has (no duplicates).

    This is the one stop rule of generation: the router and the single-turn fast path both send
    these ids to the engine as ``stop_token_ids``, so a model that closes its turn with
    ``<|im_end|>`` where the tokenizer's EOS is ``<|endoftext|>`` (or the other way round) stops
    the same way on both paths.
    """
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    ids += [int(vocab[t]) for t in TURN_END_TOKENS if t in vocab]
    return tuple(dict.fromkeys(ids))


class ChatRenderer:
    """Renders chat messages to token ids with a tokenizer's chat template, incrementally.

    ``turn_end_ids`` are the token ids that end an assistant turn; the router also sends them
    to the engine as ``stop_token_ids``. By default they are :func:`turn_end_token_ids`: the
    tokenizer's EOS token plus every token of :data:`TURN_END_TOKENS` the vocabulary has.
    """

    def __init__(self, tokenizer: Any, *, turn_end_ids: Iterable[int] | None = None,
                 chat_template: str | None = None) -> None:
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat template; pass chat_template=...")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        if turn_end_ids is None:
            turn_end_ids = turn_end_token_ids(tokenizer)
        self.turn_end_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in turn_end_ids))
        if not self.turn_end_ids:
            raise TemplateError("no turn-end token: the tokenizer has no EOS token; pass turn_end_ids=...")
        self._turn_end_text = {i: tokenizer.decode([i], skip_special_tokens=False) for i in self.turn_end_ids}

    # ---------------------------------------------------------------------------------------
    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None, *,
               add_generation_prompt: bool, template_kwargs: Mapping[str, Any] | None = None,
               continue_final: bool = False) -> str:
        """The chat template's text for ``messages`` (and ``tools``). ``continue_final``: the last
        (assistant) message is left open, for the model to continue (a prefill)."""
        try:
            text = self.tokenizer.apply_chat_template(
                [template_message(m) for m in messages], tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt and not continue_final, tokenize=False,
                chat_template=self.chat_template, **dict(template_kwargs or {}),
                **({"continue_final_message": True} if continue_final else {}))
        except Exception as exc:  # jinja raises many types; report them uniformly
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(text, str):
            raise TemplateError(f"chat template returned {type(text).__name__}, expected text")
        return text

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added: templates write their own special tokens)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens kept (tool-call and reasoning markers are special)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                      template_kwargs: Mapping[str, Any] | None = None, continue_final: bool = False) -> list[int]:
        """Tokens of a fresh segment: the whole conversation plus the generation prompt (or, with
        ``continue_final``, up to the open final assistant message)."""
        return self.encode(self.render(messages, tools, add_generation_prompt=True, template_kwargs=template_kwargs,
                                       continue_final=continue_final))

    # ---------------------------------------------------------------------------------------
    def closing_text(self, prev: str, last_generated: int | None) -> str:
        """Template text that closes the recorded assistant turn after the model's last token.

        ``prev`` is the template's rendering of the recorded conversation (ending with that
        assistant turn); ``last_generated`` the last token the model produced (``None`` if none).
        """
        if last_generated in self._turn_end_text:
            own = self._turn_end_text[last_generated]
            at = prev.rfind(own)
            if at >= 0:
                return prev[at + len(own):]
            at, text = self._last_turn_end(prev)
            return prev[at + len(text):] if at >= 0 else ""
        at, _ = self._last_turn_end(prev)
        return prev[at:] if at >= 0 else ""

    def _last_turn_end(self, text: str) -> tuple[int, str]:
        best, best_text = -1, ""
        for t in self._turn_end_text.values():
            at = text.rfind(t)
            if at > best:
                best, best_text = at, t
        return best, best_text

    def delta_text(self, recorded: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]],
                   tools: Sequence[Mapping[str, Any]] | None, last_generated: int | None,
                   template_kwargs: Mapping[str, Any] | None = None, continue_final: bool = False) -> str | None:
        """Text to append after the recorded tokens so that they continue as ``recorded + new``
        (``continue_final``: the last new message is an open assistant message, a prefill).

        Returns ``None`` when no delta can be derived (the caller then starts a new segment).
        """
        kw = template_kwargs
        prev = self.render(recorded, tools, add_generation_prompt=False, template_kwargs=kw)
        full = self.render(list(recorded) + list(new), tools, add_generation_prompt=True, template_kwargs=kw,
                           continue_final=continue_final)
        if full.startswith(prev):
            body = full[len(prev):]
        else:
            has_system = bool(recorded) and recorded[0].get("role") in ("system", "developer")
            anchor = ([dict(recorded[0])] if has_system else []) + _ANCHOR
            a_prev = self.render(anchor, tools, add_generation_prompt=False, template_kwargs=kw)
            a_full = self.render(anchor + list(new), tools, add_generation_prompt=True, template_kwargs=kw,
                                 continue_final=continue_final)
            if not a_full.startswith(a_prev):
                return None
            body = a_full[len(a_prev):]
        return self.closing_text(prev, last_generated) + body

    def delta_tokens(self, recorded: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]],
                     tools: Sequence[Mapping[str, Any]] | None, last_generated: int | None,
                     template_kwargs: Mapping[str, Any] | None = None, continue_final: bool = False
                     ) -> list[int] | None:
        """:meth:`delta_text` tokenized (``None`` when there is no delta)."""
        text = self.delta_text(recorded, new, tools, last_generated, template_kwargs, continue_final)
        return None if text is None else self.encode(text)

    def content_of(self, ids: Sequence[int]) -> str:
        """The text of a model turn: its tokens decoded, without the final turn-end token."""
        ids = list(ids)
        if ids and ids[-1] in self._turn_end_text:
            ids = ids[:-1]
        return self.decode(ids)
