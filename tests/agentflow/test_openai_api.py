"""Request validation, response shapes, engine-answer parsing and engine choice (no server)."""

from __future__ import annotations

import pytest

from loongsage_core.agentflow import RouterError, parse_chat_request
from loongsage_core.agentflow.engines import EngineBalancer, parse_generate_response

MSGS = [{"role": "user", "content": "hi"}]


def error_of(body) -> RouterError:
    with pytest.raises(RouterError) as info:
        parse_chat_request(body)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


def test_full_request_maps_to_fields():
    req = parse_chat_request({
        "model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "sys"}]},
                                   {"role": "user", "content": "q"},
                                   {"role": "assistant", "content": None,
                                    "tool_calls": [{"id": "c1", "type": "function",
                                                    "function": {"name": "f", "arguments": "{}"}}]},
                                   {"role": "tool", "tool_call_id": "c1", "content": "r"}],
        "temperature": 0.5, "top_p": 0.9, "max_completion_tokens": 7, "max_tokens": 99, "stop": "END",
        "seed": 3, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2,
        "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
        "user": "u", "parallel_tool_calls": True, "top_k": 20, "chat_template_kwargs": {"enable_thinking": False}})
    assert req.messages[0] == {"role": "developer", "content": "sys"}
    assert req.messages[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert (req.temperature, req.top_p, req.max_tokens, req.stop, req.seed) == (0.5, 0.9, 7, ["END"], 3)
    assert req.stream and req.include_usage and req.logprobs and req.top_logprobs == 2 and req.top_k == 20
    assert req.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize("body,param", [
    ({"messages": MSGS, "foo": 1}, "foo"),
    ({"messages": MSGS, "n": 3}, "n"),
    ({"messages": MSGS, "temperature": "hot"}, "temperature"),
    ({"messages": MSGS, "temperature": True}, "temperature"),
    ({"messages": MSGS, "top_p": 1.5}, "top_p"),
    ({"messages": MSGS, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSGS, "stop": [1]}, "stop"),
    ({"messages": MSGS, "logit_bias": {"5": 10}}, "logit_bias"),
    ({"messages": MSGS, "response_format": {"type": "yaml"}}, "response_format.type"),
    ({"messages": MSGS, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": MSGS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"messages": MSGS, "tool_choice": "required"}, "tool_choice"),
    ({"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"messages": MSGS, "tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].image_url.url"),
])
def test_invalid_fields_name_the_parameter(body, param):
    assert error_of(body).param == param


def test_error_body_shape():
    err = error_of({"messages": MSGS, "foo": 1})
    assert err.body() == {"error": {"message": "Unrecognized request argument supplied: foo",
                                    "type": "invalid_request_error", "param": "foo", "code": "unknown_parameter"}}
    assert error_of([1, 2]).code == "invalid_json"


def test_engine_answer_parsing():
    out = parse_generate_response({"output_ids": [5, 6, 2], "meta_info": {
        "finish_reason": {"type": "stop", "matched": 2},
        "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None], [-0.3, 2, None]],
        "weight_version": "4", "weight_versions": [{"version": "3", "start": 0, "end": 1},
                                                   {"version": "4", "start": 1, "end": 3}]}}, "u")
    assert (out.output_ids, out.logprobs, out.weight_versions, out.finish_reason) == \
        ([5, 6, 2], [-0.1, -0.2, -0.3], [3, 4, 4], "stop")
    per_token = parse_generate_response({"output_ids": [1], "meta_info": {
        "finish_reason": {"type": "abort"}, "output_token_logprobs": [[-1.0, 1, None]],
        "output_token_weight_versions": [9], "weight_version": "1"}}, "u")
    assert per_token.weight_versions == [9] and per_token.finish_reason == "abort"
    with pytest.raises(RouterError, match="1 log-probs for 2 tokens") as info:
        parse_generate_response({"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[0.0, 1, None]]}},
                                "http://e")
    assert info.value.status == 502


def test_balancer_is_sticky_and_prefers_idle_engines():
    lb = EngineBalancer(["http://a/", "http://b"])
    assert lb.urls == ["http://a", "http://b"]
    first = lb.pick("t1")
    lb.acquire(first)
    second = lb.pick("t2")
    assert second != first  # t1's engine is busy
    lb.release(first)
    assert lb.pick("t1") == first and lb.pick("t2") == second  # sticky
    third = lb.pick("t3")  # both idle: the one with fewer trajectories, then list order
    assert third == "http://a"
    lb.set_engines(["http://b"])
    assert lb.pick("t1") == "http://b"
    with pytest.raises(ValueError):
        EngineBalancer([])
