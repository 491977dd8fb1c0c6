"""A chat conversation as training tokens, rendered exactly as the AgentFlow router records it.

The router builds a trajectory turn by turn with :class:`~loongsage_core.agentflow.ConversationTracker`:
each request's new messages are rendered by the chat template and appended (loss mask 0), then
the model's output tokens (loss mask 1). Supervised data is a finished conversation, so the same
tracker is driven as if the model had written each assistant message: for every assistant
message, the messages before it are planned like a request, and the assistant turn's own tokens
are committed as the model's output. The result is token for token what the router records when
a model writes those answers (``tests/agentflow/test_sft_matches_router.py`` checks it against a
real router and engine), so a model fine-tuned here sees the same tokens it will be run on.

An assistant turn's tokens are the template's text for that turn after the generation prompt, up
to and including its turn-end token (``<|im_end|>`` in ChatML), tokenized on their own as the
engine's output would be. A template that restyles history can start a new segment (as in the
router); every segment with an assistant turn is one training example.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs

from ..agentflow.conversation import ConversationTracker
from ..agentflow.tito import ChatRenderer


class ConversationError(ValueError):
    """A row's conversation cannot be trained on (no assistant turn, not chat messages, ...)."""


@attrs.define
class Example:
    """One training sequence: token ids and a 0/1 loss mask of the same length."""

    tokens: list[int]
    loss_mask: list[int]

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ConversationError(f"expected a non-empty list of chat messages, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ConversationError(f"message {i} is not a chat message with a 'role': {str(m)[:60]!r}")
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def assistant_tokens(renderer: ChatRenderer, context: Sequence[Mapping[str, Any]], message: Mapping[str, Any],
                     tools: Sequence[Mapping[str, Any]] | None) -> list[int]:
    """The tokens a model writes for ``message`` after ``context``: the template's text of the turn
    after the generation prompt, through its turn-end token (appended if the template has none)."""
    prompt = renderer.render(context, tools, add_generation_prompt=True)
    full = renderer.render(list(context) + [dict(message)], tools, add_generation_prompt=False)
    if full.startswith(prompt):
        body = full[len(prompt):]
        turn_ends = [renderer.decode([i]) for i in renderer.turn_end_ids]
        ends = [(body.find(text), text) for text in turn_ends if text and text in body]
        if ends:
            at, text = min(ends)
            return renderer.encode(body[:at + len(text)])
        return renderer.encode(body) + [renderer.turn_end_ids[0]]
    # a template that renders a final answer unlike a generated one: the content and the turn end
    return renderer.encode(str(message.get("content") or "")) + [renderer.turn_end_ids[0]]


def render_conversation(renderer: ChatRenderer, messages: Any, tools: Sequence[Mapping[str, Any]] | None = None,
                        *, loss_on: str = "assistant") -> list[Example]:
    """The training examples of one conversation (one per router segment with an assistant turn).

    ``loss_on = "assistant"``: mask 1 on the assistant turns' tokens (their turn-end token
    included), 0 elsewhere; ``"all"``: 1 on every token but the first. Messages after the last
    assistant message are not rendered (they would train nothing).
    """
    msgs = _check_messages(messages)
    tracker = ConversationTracker(renderer)
    answered = False
    for i, msg in enumerate(msgs):
        if msg["role"] != "assistant":
            continue
        if i == 0:
            raise ConversationError("the conversation starts with an assistant message; it needs a message "
                                    "(system or user) before the first answer")
        context = msgs[:i]
        plan = tracker.plan(context, [dict(t) for t in tools] if tools else None)
        generated = assistant_tokens(renderer, context, msg, tools)
        n = len(generated)
        tracker.commit(plan, generated, [0.0] * n, [0] * n, msg)
        answered = True
    if not answered:
        raise ConversationError("the conversation has no assistant message to train on")
    examples = []
    for seg in tracker.segments:
        if not any(seg.loss_mask):
            continue
        mask = list(seg.loss_mask) if loss_on == "assistant" else [0] + [1] * (len(seg.tokens) - 1)
        examples.append(Example(tokens=list(seg.tokens), loss_mask=mask))
    return examples
