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
SPACE = st.sampled_from(["\n", " ", "\n\n", "\t "])
CALL = st.builds(lambda a: f'<tool_call>{{"name": "add", "arguments": {{"a": {a}}}}}</tool_call>', st.integers(0, 9))
BAD_CALL = st.just("<tool_call>{oops}</tool_call>")
OTHER_CALLS = st.sampled_from(['[TOOL_CALLS][{"name": "add", "arguments": {}}]', '{"name": "add", "parameters": {}}',
                               '<|python_tag|>{"name": "add", "parameters": {"a": 1}}', '<tool_call>{"name": "rm"}'
                               '</tool_call>'])
THINK = st.builds(lambda t: f"<think>{t}</think>", PLAIN)
MARKERS = st.sampled_from(["<think>", "</think>", "<tool_call>", "</tool_call>", "[TOOL_CALLS]"])
TEXTS = st.lists(st.one_of(PLAIN, SPACE, CALL, BAD_CALL, OTHER_CALLS, THINK, MARKERS), max_size=6).map("".join)


def middleware_chain(reasoning: bool, tool_format: str | None, known_only: bool) -> list:
    chain: list = [ReasoningParser()] if reasoning else []
    if tool_format is not None:
        chain.append(ToolCallParser(tool_format, known_tools_only=known_only))
    return chain


def run_stream(text: str, cuts: list[int], middlewares: list, stops: list[str],
               request: dict = REQUEST) -> tuple[dict, dict]:
    """Feed ``text`` in pieces (one "token" per character, cut into chunks at ``cuts``)."""
    streamer = TextStreamer(lambda ids: text[:len(ids)], middlewares, "t", request, stops)
    sent = {"content": "", "reasoning_content": ""}
    for end in sorted(set(cuts)) + [len(text)]:
        for field, piece in streamer.update(list(range(end))).items():
            sent[field] += piece
    # the router's final pass: the real on_response over the whole (stop-cut) text
    content, _ = cut_at_stop(text, stops)
    response = {"choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                             "finish_reason": "stop"}]}
    for mw in middlewares:
        response = mw.on_response("t", copy.deepcopy(request), response)
    message = response["choices"][0]["message"]
    for field, piece in streamer.finish(message).items():
        sent[field] += piece
    assert not streamer.broken
    return sent, message


@settings(max_examples=400, deadline=None)
@given(text=TEXTS, cuts=st.lists(st.integers(0, 160), max_size=30),
       stops=st.lists(st.sampled_from(["STOP", "b_", "\n\n"]), max_size=2),
       reasoning=st.booleans(), tool_format=st.sampled_from([None, "hermes", "llama3_json", "mistral"]),
       known_only=st.booleans(), choice=st.sampled_from([None, "auto", "none"]), tools=st.booleans())
def test_streamed_text_is_exactly_the_final_message(text, cuts, stops, reasoning, tool_format, known_only, choice,
                                                    tools):
    """Whatever the text, its cuts into engine updates and the middleware chain, what is streamed
    adds up to the final message, white space included, and nothing is ever taken back."""
    request = {**REQUEST, **({"tool_choice": choice} if choice else {})}
    if not tools:
        request.pop("tools")
    sent, message = run_stream(text, cuts, middleware_chain(reasoning, tool_format, known_only), stops, request)
    assert sent["content"] == (message.get("content") or "")
    assert sent["reasoning_content"] == (message.get("reasoning_content") or "")
    if message.get("tool_calls"):
        assert "<tool_call>" not in sent["content"] or "<tool_call>" in (message.get("content") or "")


def test_an_answer_that_starts_with_white_space_streams_whole():
    """An answer starting with a newline, through the tool-call parser, streams every word."""
    pieces = ["\n", "Hello", " world"]
    streamer = TextStreamer(lambda ids: "".join(pieces[:len(ids)]), [ToolCallParser("hermes")], "t", REQUEST, [])
    sent = [streamer.update([0, 1]), streamer.update([0, 1, 2])]
    assert sent == [{"content": "Hello"}, {"content": " world"}] and not streamer.broken


def test_tool_choice_none_never_shows_call_markup():
    text = 'Sure. <tool_call>{"name": "add", "arguments": {}}</tool_call> Done. <tool_call>{"na'
    sent, message = run_stream(text, list(range(len(text))), [ToolCallParser("hermes")], [],
                               {**REQUEST, "tool_choice": "none"})
    assert sent["content"] == message["content"] == "Sure.  Done." and "tool_calls" not in message


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
