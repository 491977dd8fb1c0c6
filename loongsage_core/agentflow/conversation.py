"""Per-trajectory token bookkeeping: which segment a request continues, and what it appends.

:class:`ConversationTracker` owns a trajectory's segments. For each request it makes a
:class:`TurnPlan` (continue the current segment with a delta, or start a new one) without
changing anything; after the engine answered, :meth:`ConversationTracker.commit` appends the
delta with loss mask 0 and the generated tokens with mask 1, their log-probs and weight versions.
A turn whose generation fails is simply never committed.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs

from loongsage_hookspecs import RoutedExperts, Segment

from .messages import same_messages
from .tito import ChatRenderer


@attrs.define
class SegmentState:
    """What a segment's tokens represent: the recorded conversation (ending with the model's
    last answer), the tools and template arguments it was rendered with, and the last token the
    model produced."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]
    last_generated: int | None


@attrs.define
class TurnPlan:
    """How one request maps onto the segments: ``context`` goes to the engine."""

    segment_index: int
    new_segment: bool
    delta: list[int]
    context: list[int]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]
    reason: str = ""
    continue_final: bool = False
    """The last message is an open assistant message (a prefill) the model continues."""

    def answered(self, assistant_message: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The conversation once the model answered: the answer appended, or, continuing a
        prefill, joined to it (its text first)."""
        if not self.continue_final:
            return self.messages + [dict(assistant_message)]
        prefill = self.messages[-1]
        joined = {**dict(assistant_message), "content": (prefill.get("content") or "")
                  + (assistant_message.get("content") or "")}
        return self.messages[:-1] + [joined]


class ConversationTracker:
    """Segments of one trajectory plus the conversation state needed to extend them."""

    def __init__(self, renderer: ChatRenderer, segments: list[Segment] | None = None) -> None:
        self.renderer = renderer
        self.segments: list[Segment] = segments if segments is not None else []
        self.state: SegmentState | None = None

    def _extends(self, messages: Sequence[Mapping[str, Any]], tools: Any, kwargs: Mapping[str, Any]) -> str:
        """Empty string if ``messages`` extends the current segment, else why it does not."""
        st = self.state
        if st is None:
            return "first request"
        if (st.tools or None) != (tools or None):
            return "tools changed"
        if dict(st.template_kwargs) != dict(kwargs):
            return "chat_template_kwargs changed"
        n = len(st.messages)
        if len(messages) <= n:
            return "request does not add messages to the recorded conversation"
        if not same_messages(messages[:n], st.messages):
            return "request does not repeat the recorded conversation"
        return ""

    def plan(self, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None = None,
             template_kwargs: Mapping[str, Any] | None = None, continue_final: bool = False) -> TurnPlan:
        """Decide how ``messages`` continue the record; nothing is changed until :meth:`commit`.
        ``continue_final``: the last message is an assistant prefill the model continues (its
        text is rendered with loss mask 0, and the turn stays open)."""
        kwargs = dict(template_kwargs or {})
        msgs = [dict(m) for m in messages]
        reason = self._extends(msgs, tools, kwargs)
        if not reason:
            st = self.state
            assert st is not None
            delta = self.renderer.delta_tokens(st.messages, msgs[len(st.messages):], tools, st.last_generated, kwargs,
                                               continue_final)
            if delta is not None:
                seg = self.segments[-1]
                return TurnPlan(len(self.segments) - 1, False, delta, seg.tokens + delta, msgs, tools, kwargs,
                                continue_final=continue_final)
            reason = "chat template renders the conversation inconsistently"
        tokens = self.renderer.prompt_tokens(msgs, tools, kwargs, continue_final)
        return TurnPlan(len(self.segments), True, tokens, list(tokens), msgs, tools, kwargs, reason, continue_final)

    def commit(self, plan: TurnPlan, generated: Sequence[int], logprobs: Sequence[float],
               weight_versions: Sequence[int], assistant_message: Mapping[str, Any],
               routed_experts: RoutedExperts | None = None) -> Segment:
        """Append the plan's delta (mask 0) and the model's tokens (mask 1); remember the answer.
        ``routed_experts``: the engine's routing of the turn's last call (its input was the
        segment so far, so it covers the whole segment; :meth:`Segment.record_routes`)."""
        if plan.new_segment:
            if plan.segment_index != len(self.segments):
                raise RuntimeError("stale turn plan: segments changed since it was made")
            self.segments.append(Segment())
        elif plan.segment_index != len(self.segments) - 1:
            raise RuntimeError("stale turn plan: segments changed since it was made")
        seg = self.segments[plan.segment_index]
        if len(seg.tokens) + len(plan.delta) != len(plan.context):
            raise RuntimeError("stale turn plan: the segment grew since it was made")
        seg.append(plan.delta, generated=False)
        if generated:
            seg.append(list(generated), generated=True, logprobs=list(logprobs), weight_version=list(weight_versions))
        seg.record_routes(routed_experts)
        last = int(generated[-1]) if generated else None
        self.state = SegmentState(messages=plan.answered(assistant_message), tools=plan.tools,
                                  template_kwargs=plan.template_kwargs, last_generated=last)
        return seg
