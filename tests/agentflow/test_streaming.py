"""Streaming a turn through response middleware: what is sent while tokens arrive adds up to the
final message, and a tool call being written never leaks out as text."""

from __future__ import annotations

import copy
import json

from hypothesis import given, settings
from hypothesis import strategies as st
from loongsage_plugin_agents.reasoning_parser import ReasoningParser
from loongsage_plugin_agents.request_logger import RequestLogger
from loongsage_plugin_agents.tool_parser import ToolCallParser

from loongsage_core.agentflow.streaming import TextStreamer, changes_responses, cut_at_stop, stop_holdback
from loongsage_hookspecs import ObservingMiddleware

REQUEST = {"messages": [{"role": "user", "content": "q"}],
           "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]}
PLAIN = st.text(alphabet=st.sampled_from(list("ab <>/{}\"\n_")), max_size=8)
CALL = st.builds(lambda a: f'<tool_call>{{"name": "add", "arguments": {{"a": {a}}}}}</tool_call>', st.integers(0, 9))
THINK = st.builds(lambda t: f"<think>{t}</think>", PLAIN)


def run_stream(text: str, cuts: list[int], middlewares: list, stops: list[str]) -> tuple[dict, dict]:
    """Feed ``text`` in pieces (one "token" per character, cut into chunks at ``cuts``)."""
    streamer = TextStreamer(lambda ids: text[:len(ids)], middlewares, "t", REQUEST, stops)
    sent = {"content": "", "reasoning_content": ""}
    for end in sorted(set(cuts)) + [len(text)]:
        for field, piece in streamer.update(list(range(end))).items():
            sent[field] += piece
    # the router's final pass: the real on_response over the whole (stop-cut) text
    content, _ = cut_at_stop(text, stops)
    response = {"choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                             "finish_reason": "stop"}]}
    for mw in middlewares:
        response = mw.on_response("t", copy.deepcopy(REQUEST), response)
    message = response["choices"][0]["message"]
    for field, piece in streamer.finish(message).items():
        sent[field] += piece
    return sent, message


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.one_of(PLAIN, CALL, THINK), max_size=5), cuts=st.lists(st.integers(0, 120), max_size=30),
       stops=st.lists(st.sampled_from(["STOP", "b_", "\n\n"]), max_size=2))
def test_streamed_text_adds_up_to_the_final_message(parts, cuts, stops):
    text = "".join(parts)
    middlewares = [ReasoningParser(), ToolCallParser("hermes")]
    sent, message = run_stream(text, cuts, middlewares, stops)
    final = message.get("content") or ""
    # streamed text is the final text (leading white space may have been passed by already)
    assert sent["content"] in (final, final.lstrip())
    if message.get("tool_calls"):
        assert "<tool_call>" not in sent["content"] or "<tool_call>" in (message.get("content") or "")
    reasoning = message.get("reasoning_content") or ""
    assert sent["reasoning_content"] in (reasoning, reasoning.lstrip())


def test_text_streams_token_by_token_and_calls_are_held_back(tmp_path):
    text = 'Let me add. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    streamer = TextStreamer(lambda ids: text[:len(ids)], [ToolCallParser("hermes"),
                                                          RequestLogger(str(tmp_path / "log.jsonl"))],
                            "t", REQUEST, [])
    pieces = [streamer.update(list(range(n))).get("content", "") for n in range(1, len(text) + 1)]
    assert "".join(pieces) == "Let me add."  # the call is held back; the rest came as it was written
    assert sum(1 for p in pieces if p) >= 8
    assert not (tmp_path / "log.jsonl").exists()  # the logger only sees the final response
    json.dumps(pieces)


def test_a_middleware_without_stream_support_holds_everything():
    class Shout:
        def on_request(self, tid, request):
            return request

        def on_response(self, tid, request, response):
            response["choices"][0]["message"]["content"] = response["choices"][0]["message"]["content"].upper()
            return response

    streamer = TextStreamer(lambda ids: "hello"[:len(ids)], [Shout()], "t", REQUEST, [])
    assert streamer.update([0, 1, 2]) == {}
    assert streamer.finish({"content": "HELLO"}) == {"content": "HELLO"}


def test_a_declared_observer_is_left_out_of_partial_views_and_any_other_middleware_holds_the_stream():
    """``changes_response = False`` (the ObservingMiddleware capability) keeps a middleware out of
    the partial views, so text streams past it; the same middleware saying it changes responses,
    or saying nothing, holds the turn's text until its end."""
    seen: list = []

    class Observer:
        changes_response = False

        def on_request(self, tid, request):
            return request

        def on_response(self, tid, request, response):
            seen.append(response["choices"][0]["finish_reason"])
            return response

    class Rewriter(Observer):
        changes_response = True

    class Undeclared:
        on_request, on_response = Observer.on_request, Observer.on_response

    assert isinstance(Observer(), ObservingMiddleware) and not changes_responses(Observer())
    assert isinstance(Rewriter(), ObservingMiddleware) and changes_responses(Rewriter())
    assert not isinstance(Undeclared(), ObservingMiddleware) and changes_responses(Undeclared())
    streamer = TextStreamer(lambda ids: "hello"[:len(ids)], [Observer()], "t", REQUEST, [])
    assert streamer.update([0, 1, 2]) == {"content": "hel"}
    assert seen == []  # an observer never sees a partial response
    for held in (Rewriter(), Undeclared()):
        streamer = TextStreamer(lambda ids: "hello"[:len(ids)], [held], "t", REQUEST, [])
        assert streamer.update([0, 1, 2]) == {}
        assert streamer.finish({"content": "hello"}) == {"content": "hello"}


def test_stop_strings_and_incomplete_characters_are_held_back():
    assert stop_holdback("abcST", ["STOP"]) == 2 and stop_holdback("abc", ["STOP"]) == 0
    assert cut_at_stop("xxSTOPyySTOP", ["yy", "STOP"]) == ("xx", "STOP")
    streamer = TextStreamer(lambda ids: "ab\ufffd"[:len(ids)], [], "t", REQUEST, [])
    assert streamer.update([0, 1, 2]) == {"content": "ab"}  # the half character waits for its bytes
