"""Router middleware of loongsage-plugin-agents on OpenAI-shaped requests and responses."""

from __future__ import annotations

import json

import pytest
from loongsage_plugin_agents import plugin
from loongsage_plugin_agents.reasoning_parser import ReasoningParser, split_reasoning
from loongsage_plugin_agents.request_logger import RequestLogger
from loongsage_plugin_agents.tool_parser import ToolCallParser

from loongsage_hookspecs import BuildContext

TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def response(content, finish="stop"):
    return {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                         "finish_reason": finish}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def request(tools=TOOLS, **extra):
    return {"messages": [{"role": "user", "content": "q"}], "tools": tools, **extra}


def calls_of(resp):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in resp["choices"][0]["message"].get("tool_calls", [])]


def test_specs_are_registered():
    names = {s.name for s in plugin.loongsage_router_middlewares()}
    assert names == {"tool_call_parser", "reasoning_parser", "request_logger"}
    specs = {s.name: s for s in plugin.loongsage_router_middlewares()}
    assert isinstance(specs["tool_call_parser"].factory(BuildContext(), format="mistral"), ToolCallParser)


def test_hermes_tool_calls_become_openai_tool_calls():
    text = ('Let me look.\n<tool_call>\n{"name": "search", "arguments": {"q": "cats", "n": 2}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>')
    out = ToolCallParser("hermes").on_response("t", request(), response(text))
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    assert calls_of(out) == [("search", {"q": "cats", "n": 2}), ("add", {"a": 1})]
    ids = [c["id"] for c in choice["message"]["tool_calls"]]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert all(c["type"] == "function" and isinstance(c["function"]["arguments"], str)
               for c in choice["message"]["tool_calls"])


def test_hermes_invalid_blocks_stay_in_the_content():
    text = '<tool_call>{"name": "search", "arguments": {oops}</tool_call> and <tool_call>{"arguments": {}}</tool_call>'
    out = ToolCallParser().on_response("t", request(), response(text))
    assert out["choices"][0]["message"]["content"] == text
    assert "tool_calls" not in out["choices"][0]["message"] and out["choices"][0]["finish_reason"] == "stop"
    # only content is tool calls: content becomes None
    out = ToolCallParser().on_response("t", request(), response('<tool_call>{"name": "add"}</tool_call>'))
    assert out["choices"][0]["message"]["content"] is None and calls_of(out) == [("add", {})]


def test_no_parsing_without_tools_and_no_calls_with_tool_choice_none():
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    out = ToolCallParser().on_response("t", request(tools=None), response(text))
    assert out["choices"][0]["message"]["content"] == text
    # tool_choice "none": no call, and the markup the model wrote anyway is not shown as text
    for fmt, written in (("hermes", f"I will not call.\n{text}\n<tool_call>{{bad"),
                         ("mistral", 'I will not call. [TOOL_CALLS][{"name": "add"}]'),
                         ("llama3_json", '{"name": "add", "parameters": {}}')):
        out = ToolCallParser(fmt).on_response("t", request(tool_choice="none"), response(written))
        message = out["choices"][0]["message"]
        assert "tool_calls" not in message and out["choices"][0]["finish_reason"] == "stop"
        assert message["content"] == ("" if fmt == "llama3_json" else "I will not call."), fmt


def test_content_is_stripped_whether_or_not_a_call_was_found():
    """The same white-space rule for every answer, so streamed text adds up to the final text."""
    for text in ("\n\nHello world \n", '\nHello <tool_call>{"name": "add"}</tool_call>\n'):
        out = ToolCallParser().on_response("t", request(), response(text))
        assert out["choices"][0]["message"]["content"] == "Hello" + (" world" if "world" in text else "")
    # a truncated turn keeps finish_reason "length" even when a call parsed
    out = ToolCallParser().on_response("t", request(), response(text, finish="length"))
    assert out["choices"][0]["finish_reason"] == "length" and calls_of(out) == [("add", {})]


def test_known_tools_only():
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    out = ToolCallParser(known_tools_only=True).on_response("t", request(), response(text))
    assert out["choices"][0]["message"]["content"] == text
    assert calls_of(ToolCallParser().on_response("t", request(), response(text))) == [("rm_rf", {})]


def test_llama3_json_format():
    p = ToolCallParser("llama3_json")
    out = p.on_response("t", request(), response('<|python_tag|>{"name": "search", "parameters": {"q": "x"}}'))
    assert calls_of(out) == [("search", {"q": "x"})] and out["choices"][0]["message"]["content"] is None
    two = '{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {}}'
    out = p.on_response("t", request(), response(two))
    assert calls_of(out) == [("add", {"a": 1}), ("add", {})]
    for text in ('The answer is {"name": "x"}', '{"name": "add", "parameters": {}} trailing words', '{"no": "name"}'):
        out = p.on_response("t", request(), response(text))
        assert out["choices"][0]["message"]["content"] == text and not calls_of(out)


def test_mistral_format():
    p = ToolCallParser("mistral")
    out = p.on_response("t", request(), response('Sure. [TOOL_CALLS][{"name": "search", "arguments": {"q": "y"}}]'))
    assert calls_of(out) == [("search", {"q": "y"})] and out["choices"][0]["message"]["content"] == "Sure."
    bad = "[TOOL_CALLS] not json"
    assert p.on_response("t", request(), response(bad))["choices"][0]["message"]["content"] == bad


def test_unknown_format_is_an_error():
    with pytest.raises(ValueError, match="unknown format 'xml'.*hermes"):
        ToolCallParser("xml")


@pytest.mark.parametrize("text,reasoning,answer", [
    ("<think>\nstep 1\n</think>\n\nIt is 4.", "step 1", "It is 4."),
    ("step 1 (tag in the prompt)</think>It is 4.", "step 1 (tag in the prompt)", "It is 4."),
    ("<think>cut off while thinking", "cut off while thinking", ""),
    ("No reasoning here.", None, "No reasoning here."),
    ("a</think>b<think>c", "a", "b<think>c"),
])
def test_split_reasoning(text, reasoning, answer):
    assert split_reasoning(text) == (reasoning, answer)


def test_reasoning_parser_then_tool_parser():
    text = '<think>I should call add, maybe <tool_call>{"name": "search"}</tool_call>?</think>' \
           '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    resp = response(text)
    for mw in (ReasoningParser(), ToolCallParser()):  # job-file order
        resp = mw.on_response("t", request(), resp)
    msg = resp["choices"][0]["message"]
    assert msg["reasoning_content"].startswith("I should call add")
    assert calls_of(resp) == [("add", {"a": 2})] and msg["content"] is None


def test_request_logger_writes_jsonl(tmp_path):
    path = tmp_path / "logs" / "requests.jsonl"
    logger = RequestLogger(str(path))
    req = request()
    assert logger.on_request("traj-7", req) is req
    resp = response("hi")
    assert logger.on_response("traj-7", req, resp) is resp
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["trajectory_id"], r["event"]) for r in lines] == [("traj-7", "request"), ("traj-7", "response")]
    assert lines[0]["body"] == req and lines[1]["body"] == resp
    RequestLogger(str(path), requests=False).on_request("t", req)
    assert len(path.read_text().splitlines()) == 2
