"""Per-trajectory token bookkeeping: which segment a request continues, and what it appends.

:class:`ConversationTracker` owns a trajectory's segments. For each request it makes a
:class:`TurnPlan` without changing anything: continue a segment with a delta (any segment whose
recorded conversation the request extends, not only the latest: a main agent resuming after a
sub-agent's turns), or fork a new one (:func:`plan_fork`). After the engine answered,
:meth:`ConversationTracker.commit` appends the delta with loss mask 0 and the generated tokens
with mask 1, their log-probs and weight versions. A turn whose generation fails is simply never
committed.

A request that continues no segment (compacted or edited history, a sub-agent's own
conversation, a changed tool list) starts a new segment that records its place in the
trajectory's tree: the earlier segment it shares the longest token prefix with (``parent``) and
the length of that prefix (``fork_at``). Its tokens are, when the request extends the
conversation some earlier turn of a segment ended with, that segment's exact tokens up to the
turn's end plus the delta (so the model's tokens are reused, never re-tokenized), and otherwise
the chat template's rendering of the request; all of them have loss mask 0 until the model
answers.
"""

from __future__ import annotations

import bisect
from typing import Any, Mapping, Sequence

import attrs

from loongsage_hookspecs import RoutedExperts, Segment, SegmentImage

from .messages import same_messages
from .tito import ChatRenderer

PREFIX_CHUNK = 256
"""Tokens compared at once by :func:`shared_prefix` (list slices compare in C)."""


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i:i + PREFIX_CHUNK] == b[i:i + PREFIX_CHUNK]:
        i += PREFIX_CHUNK
    i = min(i, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


def fork_point(tokens: Sequence[int], segments: Sequence[Segment]) -> tuple[int | None, int]:
    """Where ``tokens`` branch off the recorded ``segments``: ``(parent, fork_at)``, the segment
    sharing the longest token prefix with ``tokens`` and that prefix's length; ``(None, 0)`` when
    none shares a token.

    On a tie the earliest segment wins: a later segment that shares as many tokens forked from an
    earlier one at or after them, so the shared tokens come from the earlier one.
    """
    parent, fork_at = None, 0
    for index, seg in enumerate(segments):
        n = shared_prefix(tokens, seg.tokens)
        if n > fork_at:
            parent, fork_at = index, n
    return parent, fork_at


@attrs.define
class SegmentState:
    """What a segment's first ``end`` tokens represent: the recorded conversation (ending with the
    model's answer), the tools and template arguments it was rendered with, and the last token
    the model produced. A segment keeps one state per turn it recorded, so a later request can
    branch off after any of them."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]
    last_generated: int | None
    end: int = 0


@attrs.define
class TurnPlan:
    """How one request maps onto the segments: ``context`` goes to the engine.

    A plan that continues segment ``segment_index`` appends ``delta`` to it (``context`` is the
    segment plus ``delta``); a ``new_segment`` plan starts segment ``segment_index`` with
    ``context`` (``delta`` is the whole context), forked from segment ``parent`` after the
    ``fork_at`` tokens they share (both ``None`` for a root segment).
    """

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
    parent: int | None = None
    fork_at: int | None = None
    images: list[SegmentImage] = attrs.field(factory=list)
    """The images of ``context`` in token order (set by the router, see :mod:`.images`)."""

    def answered(self, assistant_message: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The conversation once the model answered: the answer appended, or, continuing a
        prefill, joined to it (its text first)."""
        if not self.continue_final:
            return self.messages + [dict(assistant_message)]
        prefill = self.messages[-1]
        joined = {**dict(assistant_message), "content": (prefill.get("content") or "")
                  + (assistant_message.get("content") or "")}
        return self.messages[:-1] + [joined]


def extends(state: SegmentState | None, messages: Sequence[Mapping[str, Any]], tools: Any,
            kwargs: Mapping[str, Any]) -> str:
    """Empty string if ``messages`` (with ``tools`` and template ``kwargs``) extend the conversation
    of ``state``, else why they do not."""
    if state is None:
        return "first request"
    if (state.tools or None) != (tools or None):
        return "tools changed"
    if dict(state.template_kwargs) != dict(kwargs):
        return "chat_template_kwargs changed"
    n = min(len(messages), len(state.messages))
    if not same_messages(messages[:n], state.messages[:n]):
        return "request does not repeat the recorded conversation"
    if len(messages) <= len(state.messages):
        return "request does not add messages to the recorded conversation"
    return ""


class ConversationTracker:
    """Segments of one trajectory plus the conversation states needed to extend or fork them."""

    def __init__(self, renderer: ChatRenderer, segments: list[Segment] | None = None) -> None:
        self.renderer = renderer
        self.segments: list[Segment] = segments if segments is not None else []
        self.history: list[list[SegmentState]] = [[] for _ in self.segments]
        """Per segment, its state after each of its turns (the last one: where it stands now)."""
        self.last_segment: int | None = None
        """The segment the latest committed turn went to."""

    @property
    def state(self) -> SegmentState | None:
        """The state of the segment the latest turn went to (``None`` before the first turn)."""
        return None if self.last_segment is None else self.history[self.last_segment][-1]

    def plan(self, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None = None,
             template_kwargs: Mapping[str, Any] | None = None, continue_final: bool = False) -> TurnPlan:
        """Decide how ``messages`` continue the record; nothing is changed until :meth:`commit`.
        ``continue_final``: the last message is an assistant prefill the model continues (its
        text is rendered with loss mask 0, and the turn stays open).

        The request continues the segment whose recorded conversation it extends (the one with
        the most messages, the latest on a tie); when none does, it forks a new segment."""
        kwargs = dict(template_kwargs or {})
        msgs = [dict(m) for m in messages]
        extended = sorted(((len(h[-1].messages), i) for i, h in enumerate(self.history)
                           if h and not extends(h[-1], msgs, tools, kwargs)), reverse=True)
        for _, index in extended:
            st = self.history[index][-1]
            delta = self.renderer.delta_tokens(st.messages, msgs[len(st.messages):], tools, st.last_generated, kwargs,
                                               continue_final)
            if delta is not None:
                return TurnPlan(index, False, delta, self.segments[index].tokens + delta, msgs, tools, kwargs,
                                continue_final=continue_final)
        return self._fork(msgs, tools, kwargs, continue_final)

    def _fork(self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any],
              continue_final: bool) -> TurnPlan:
        """A new segment for ``msgs``: its context is the template's rendering of the request or,
        when the request extends the conversation an earlier turn of a segment ended with, that
        segment's tokens up to the turn's end plus the delta; whichever shares more tokens with a
        recorded segment (the turn's, on a tie: it keeps the model's own tokens)."""
        context = self.renderer.prompt_tokens(msgs, tools, kwargs, continue_final)
        parent, fork_at = fork_point(context, self.segments)
        for index, states in enumerate(self.history):
            st = self._deepest_turn(states[:-1], msgs, tools, kwargs)
            if st is None:
                continue
            delta = self.renderer.delta_tokens(st.messages, msgs[len(st.messages):], tools, st.last_generated, kwargs,
                                               continue_final)
            if delta is None:
                continue
            branch = self.segments[index].tokens[:st.end] + delta
            at_parent, at = fork_point(branch, self.segments)
            if at >= fork_at:
                context, parent, fork_at = branch, at_parent, at
        if parent is None:
            reason = "first request" if not self.segments else "request shares no token with a recorded segment"
        else:
            reason = (extends(self.history[parent][-1] if self.history[parent] else None, msgs, tools, kwargs)
                      or "chat template renders the conversation inconsistently")
        return TurnPlan(len(self.segments), True, list(context), list(context), msgs, tools, kwargs, reason,
                        continue_final, parent=parent, fork_at=fork_at if parent is not None else None)

    @staticmethod
    def _deepest_turn(states: Sequence[SegmentState], msgs: Sequence[Mapping[str, Any]],
                      tools: list[dict[str, Any]] | None, kwargs: Mapping[str, Any]) -> SegmentState | None:
        """The latest of a segment's ``states`` whose conversation ``msgs`` extend, or ``None``.
        Each state's conversation extends the one before, so the states ``msgs`` extend come
        first: a binary search finds the last of them."""
        first_not = bisect.bisect_left(range(len(states)), True, key=lambda i: bool(extends(states[i], msgs, tools,
                                                                                           kwargs)))
        return states[first_not - 1] if first_not > 0 else None

    def commit(self, plan: TurnPlan, generated: Sequence[int], logprobs: Sequence[float],
               weight_versions: Sequence[int], assistant_message: Mapping[str, Any],
               routed_experts: RoutedExperts | None = None) -> Segment:
        """Append the plan's delta (mask 0) and the model's tokens (mask 1); remember the answer.
        ``routed_experts``: the engine's routing of the turn's last call (its input was the
        segment so far, so it covers the whole segment; :meth:`Segment.record_routes`)."""
        if plan.new_segment:
            if plan.segment_index != len(self.segments):
                raise RuntimeError("stale turn plan: segments changed since it was made")
            self.segments.append(Segment(parent=plan.parent, fork_at=plan.fork_at))
            self.history.append([])
        elif not 0 <= plan.segment_index < len(self.segments):
            raise RuntimeError("stale turn plan: segments changed since it was made")
        seg = self.segments[plan.segment_index]
        if len(seg.tokens) + len(plan.delta) != len(plan.context):
            raise RuntimeError("stale turn plan: the segment grew since it was made")
        seg.append(plan.delta, generated=False)
        if generated:
            seg.append(list(generated), generated=True, logprobs=list(logprobs), weight_version=list(weight_versions))
        seg.record_routes(routed_experts)
        if plan.images:  # the context's images cover the whole segment (it is the context plus the answer)
            seg.images = list(plan.images)
        last = int(generated[-1]) if generated else None
        self.history[plan.segment_index].append(SegmentState(
            messages=plan.answered(assistant_message), tools=plan.tools, template_kwargs=plan.template_kwargs,
            last_generated=last, end=len(seg.tokens)))
        self.last_segment = plan.segment_index
        return seg
