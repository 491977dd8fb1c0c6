"""Protocol fidelity against the real router and real embedded engines: every object and every
streamed event conforms to its protocol's definition (OpenResponses' schema, the official SDKs'
types in strict mode), streaming never loses or changes text, and usage reports the prompt
tokens the engine's prefix cache served.

The ``markov_engine_url`` model writes random walks of answers that start with white space or
not, reasoning blocks and hermes tool calls in any order, so a seed picks a different answer and
different token boundaries each time.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loongsage_plugin_agents.reasoning_parser import ReasoningParser
from loongsage_plugin_agents.tool_parser import ToolCallParser

PARAMETERS = {"type": "object", "properties": {"a": {"type": "integer"}}}
TOOLS = {
    "chat": [{"type": "function", "function": {"name": "add", "description": "add", "parameters": PARAMETERS}}],
    "responses": [{"type": "function", "name": "add", "description": "add", "parameters": PARAMETERS}],
    "anthropic": [{"name": "add", "description": "add", "input_schema": PARAMETERS}],
}
CHAINS = {"none": [], "reasoning": ["reasoning"], "tools": ["tools"], "both": ["reasoning", "tools"]}


def chain(names: list[str]) -> list[Any]:
    return [ReasoningParser() if n == "reasoning" else ToolCallParser("hermes") for n in names]


def request_body(protocol: str, stream: bool, tools: bool, choice: str | None, max_tokens: int = 40,
                 messages: list[dict] | None = None) -> tuple[str, dict]:
    """The path and body of one turn in ``protocol`` (``choice``: the chat spelling of tool_choice)."""
    messages = messages or [{"role": "user", "content": "hi"}]
    body: dict[str, Any] = {"model": "p", "stream": stream}
    if protocol == "chat":
        body.update(messages=messages, max_tokens=max_tokens)
        if stream:
            body["stream_options"] = {"include_usage": True}
    elif protocol == "responses":
        body.update(input=messages, max_output_tokens=max_tokens)
    else:
        body.update(messages=messages, max_tokens=max_tokens)
    if tools:
        body["tools"] = copy.deepcopy(TOOLS[protocol])
        if choice is not None:
            body["tool_choice"] = {"type": choice} if protocol == "anthropic" else choice
    path = {"chat": "/chat/completions", "responses": "/responses", "anthropic": "/messages"}[protocol]
    return path, body


def run_turn(shapes: Any, url: str, protocol: str, stream: bool, tools: bool = False, choice: str | None = None,
             max_tokens: int = 40, messages: list[dict] | None = None) -> dict[str, Any]:
    """One turn over raw HTTP; every object and event is checked against its protocol's definition.
    Returns the text, reasoning, tool calls (name, arguments) and usage the agent was given."""
    path, body = request_body(protocol, stream, tools, choice, max_tokens, messages)
    out: dict[str, Any] = {"text": "", "reasoning": "", "calls": [], "usage": None}
    if not stream:
        resp = httpx.post(url + path, json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        answer(shapes, protocol, resp.json(), out)
        return out
    with httpx.stream("POST", url + path, json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = shapes.collect_sse(resp.iter_lines())
    streamed(shapes, protocol, events, out)
    return out


def answer(shapes: Any, protocol: str, obj: dict, out: dict) -> None:
    if protocol == "chat":
        message = shapes.check_chat(obj).choices[0].message
        out["text"] = message.content or ""
        out["reasoning"] = obj["choices"][0]["message"].get("reasoning_content") or ""
        out["calls"] = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
        out["usage"] = obj["usage"]
    elif protocol == "responses":
        shapes.check_response(obj)
        for item in obj["output"]:
            if item["type"] == "message":
                out["text"] += "".join(part["text"] for part in item["content"])
            elif item["type"] == "reasoning":
                out["reasoning"] += "".join(part["text"] for part in item["content"])
            else:
                out["calls"].append((item["name"], json.loads(item["arguments"])))
        out["usage"] = obj["usage"]
    else:
        message = shapes.check_message(obj)
        for block in message.content:
            if block.type == "text":
                out["text"] += block.text
            elif block.type == "thinking":
                out["reasoning"] += block.thinking
            else:
                out["calls"].append((block.name, block.input))
        out["usage"] = obj["usage"]


def streamed(shapes: Any, protocol: str, events: list[tuple[str | None, Any]], out: dict) -> None:
    if protocol == "chat":
        assert events[-1] == (None, "[DONE]")
        calls: dict[int, list[str]] = {}
        for _, chunk in events[:-1]:
            shapes.check_chat_chunk(chunk)
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            for choice in chunk["choices"]:
                delta = choice["delta"]
                out["text"] += delta.get("content") or ""
                out["reasoning"] += delta.get("reasoning_content") or ""
                for call in delta.get("tool_calls") or []:
                    calls.setdefault(call["index"], ["", ""])
                    calls[call["index"]][0] += call["function"].get("name") or ""
                    calls[call["index"]][1] += call["function"].get("arguments") or ""
        out["calls"] = [(name, json.loads(args)) for name, args in calls.values()]
    elif protocol == "responses":
        assert events[-1] == (None, "[DONE]")
        for name, event in events[:-1]:
            assert name == event["type"]  # the SSE event name is the event's type
            shapes.check_response_event(event)
        kinds = [e["type"] for _, e in events[:-1]]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert [e["sequence_number"] for _, e in events[:-1]] == list(range(len(kinds)))
        for _, event in events[:-1]:
            if event["type"] == "response.output_text.delta":
                out["text"] += event["delta"]
            elif event["type"] == "response.reasoning.delta":
                out["reasoning"] += event["delta"]
            elif event["type"] == "response.output_item.done" and event["item"]["type"] == "function_call":
                out["calls"].append((event["item"]["name"], json.loads(event["item"]["arguments"])))
        final: dict[str, Any] = {"text": "", "reasoning": "", "calls": []}
        answer(shapes, protocol, events[-2][1]["response"], final)
        assert (final["text"], final["reasoning"], final["calls"]) == (out["text"], out["reasoning"], out["calls"])
        out["usage"] = events[-2][1]["response"]["usage"]
    else:
        for name, event in events:
            assert name == event["type"]
            shapes.check_message_event(event)
        blocks: dict[int, dict] = {}
        for _, event in events:
            if event["type"] == "content_block_start":
                blocks[event["index"]] = dict(event["content_block"], partial="")
            elif event["type"] == "content_block_delta":
                delta = event["delta"]
                if delta["type"] == "text_delta":
                    out["text"] += delta["text"]
                elif delta["type"] == "thinking_delta":
                    out["reasoning"] += delta["thinking"]
                elif delta["type"] == "input_json_delta":
                    blocks[event["index"]]["partial"] += delta["partial_json"]
            elif event["type"] == "message_delta":
                out["usage"] = {**events[0][1]["message"]["usage"], **event["usage"]}
        out["calls"] = [(b["name"], json.loads(b["partial"])) for b in blocks.values() if b["type"] == "tool_use"]


def generated(record: Any) -> list[int]:
    seg = record.segments[-1]
    return [t for t, m in zip(seg.tokens, seg.loss_mask) if m]


@pytest.fixture
def routers(markov_engine_url, router_factory):
    return {name: router_factory([markov_engine_url], chain(names)) for name, names in CHAINS.items()}


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), protocol=st.sampled_from(["chat", "responses", "anthropic"]),
       chain_name=st.sampled_from(sorted(CHAINS)), tools=st.booleans(), choice=st.sampled_from([None, "auto", "none"]))
def test_streamed_answers_are_the_non_streamed_answers(routers, shapes, seed, protocol, chain_name, tools, choice):
    """Same tokens, streamed or not: the agent gets the same text, reasoning and tool calls, through
    any middleware chain, in every protocol, and every object and event conforms to the protocol."""
    router = routers[chain_name]
    got = []
    for stream in (False, True):
        tid = f"s-{seed}-{protocol}-{chain_name}-{tools}-{choice}-{stream}"
        url = router.blocking.register(tid, sampling={"seed": seed})
        got.append(run_turn(shapes, url, protocol, stream, tools, choice))
        got[-1]["tokens"] = generated(router.blocking.pop(tid))
    plain, live = got
    assert live["tokens"] == plain["tokens"]  # the same generation, so the same answer
    assert (live["text"], live["reasoning"], live["calls"]) == (plain["text"], plain["reasoning"], plain["calls"])
    if tools and choice == "none" and "tools" in CHAINS[chain_name]:  # no calls, and no call markup either
        assert not plain["calls"] and "<tool_call>" not in plain["text"] + plain["reasoning"]


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(engine_url, router_factory, shapes):
    """A second turn extends the first: the engine serves most of its prompt from its prefix
    cache, and each protocol's native field says how many tokens (the count the record keeps)."""
    router = router_factory([engine_url])
    for protocol in ("chat", "responses", "anthropic"):
        for stream in (False, True):
            tid = f"cache-{protocol}-{stream}"
            url = router.blocking.register(tid, sampling={"seed": 7, "max_new_tokens": 6})
            messages = [{"role": "user", "content": f"a long enough first question about {tid}"}]
            first = run_turn(shapes, url, protocol, stream, max_tokens=6, messages=messages)
            assistant = first["text"] or "."
            messages += [{"role": "assistant", "content": assistant}, {"role": "user", "content": "and then?"}]
            second = run_turn(shapes, url, protocol, stream, max_tokens=6, messages=messages)
            record = router.blocking.pop(tid)
            assert len(record.turns) == 2 and not record.turns[1].new_segment, protocol
            cached = record.turns[1].cached_tokens
            assert 0 < cached < record.turns[1].prompt_tokens
            usage = second["usage"]
            if protocol == "chat":
                assert usage["prompt_tokens_details"]["cached_tokens"] == cached
                assert usage["prompt_tokens"] == record.turns[1].prompt_tokens
            elif protocol == "responses":
                assert usage["input_tokens_details"]["cached_tokens"] == cached
            else:  # Anthropic counts cached prompt tokens apart from the others
                assert usage["cache_read_input_tokens"] == cached
                assert usage["input_tokens"] + cached == record.turns[1].prompt_tokens


def test_the_schema_fails_an_object_that_lacks_a_required_field(engine_url, router_factory, shapes):
    """The schema is not vacuous: every field the specification requires, dropped from a real
    response, fails it; so do the event names and the null the specification does not allow."""
    router = router_factory([engine_url])
    url = router.blocking.register("schema", sampling={"max_new_tokens": 4, "seed": 1})
    body = httpx.post(url + "/responses", json={"model": "p", "input": "hi"}, timeout=60).json()
    shapes.check_response(body)
    required = shapes._schema()["$defs"]["ResponseResource"]["required"]
    assert {"completed_at", "presence_penalty", "service_tier", "prompt_cache_key", "max_tool_calls"} <= set(required)
    for field in required:
        broken = {k: v for k, v in body.items() if k != field}
        assert shapes.schema_errors("ResponseResource", broken), field
    for field, value in (("temperature", None), ("top_p", None), ("tools", [{"type": "function", "name": "f"}])):
        assert shapes.schema_errors("ResponseResource", {**body, field: value}), field
    item = {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed", "encrypted_content": None}
    assert shapes.schema_errors("Item", item) and not shapes.schema_errors("Item", {**item, "encrypted_content": "x"})
    with pytest.raises(AssertionError, match="not an OpenResponses streaming event"):
        shapes.check_response_event({"type": "response.reasoning_text.delta", "sequence_number": 0})


class FailAtTheEnd:
    """A middleware written for this test: streams text, then fails on the final response."""

    def on_request(self, trajectory_id, request):
        return request

    def stream_holdback(self, request, text):
        return 0

    def on_response(self, trajectory_id, request, response):
        if response["choices"][0]["finish_reason"] is not None:
            raise RuntimeError("the final response is refused")
        return response


def test_a_stream_that_fails_reports_it_in_each_protocol_shape(engine_url, router_factory, shapes):
    router = router_factory([engine_url], [FailAtTheEnd()])
    for protocol in ("chat", "responses", "anthropic"):
        url = router.blocking.register(f"fail-{protocol}", sampling={"max_new_tokens": 8, "seed": 3})
        path, body = request_body(protocol, True, False, None)
        with httpx.stream("POST", url + path, json=body, timeout=60) as resp:
            assert resp.status_code == 200
            events = shapes.collect_sse(resp.iter_lines())
        if protocol == "responses":
            kinds = [e["type"] for _, e in events[:-1]]
            assert kinds[-2:] == ["error", "response.failed"] and events[-1] == (None, "[DONE]")
            for _, event in events[:-1]:
                shapes.check_response_event(event)
            assert events[-2][1]["response"]["status"] == "failed"
        elif protocol == "anthropic":
            assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "api_error"
        else:
            assert events[-1] == (None, "[DONE]") and events[-2][1]["error"]["type"] == "server_error"


def test_a_turn_cut_at_its_token_limit_is_an_incomplete_response(engine_url, router_factory, shapes):
    router = router_factory([engine_url])
    for stream in (False, True):
        url = router.blocking.register(f"cut-{stream}", sampling={"seed": 2, "ignore_eos": True})
        path, body = request_body("responses", stream, False, None, max_tokens=3)
        if not stream:
            response = httpx.post(url + path, json=body, timeout=60).json()
        else:
            with httpx.stream("POST", url + path, json=body, timeout=60) as resp:
                events = shapes.collect_sse(resp.iter_lines())
            for _, event in events[:-1]:
                shapes.check_response_event(event)
            response = events[-2][1]["response"]
        shapes.check_response(response)
        assert response["status"] == "incomplete" and response["completed_at"] is None
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}
        assert response["output"][-1]["status"] == "incomplete"
        assert response["temperature"] == 1.0 and response["top_p"] == 1.0 and response["max_output_tokens"] == 3


@pytest.mark.parametrize("protocol", ["chat", "responses", "anthropic"])
def test_absurd_token_limits_are_refused_and_large_ones_lowered_and_said(engine_url, router_factory, protocol):
    """A token limit beyond any integer an engine takes is a 400 (its message short); one beyond
    the context is lowered to the room left, and the answer's header says to what."""
    context = httpx.get(engine_url + "/get_model_info", timeout=10).json()["max_context_length"]
    router = router_factory([engine_url])
    url = router.blocking.register(f"big-{protocol}", sampling={"seed": 1, "max_new_tokens": 10**6})
    key = {"chat": "max_tokens", "responses": "max_output_tokens", "anthropic": "max_tokens"}[protocol]
    path, body = request_body(protocol, False, False, None)
    resp = httpx.post(url + path, content=json.dumps({**body, key: 10**400}),
                      headers={"content-type": "application/json"}, timeout=60)
    assert resp.status_code == 400 and len(resp.text) < 400 and "2147483647" in resp.text, resp.text
    for stream in (False, True):
        path, body = request_body(protocol, stream, False, None)
        with httpx.stream("POST", url + path, json={**body, key: 10**6}, timeout=60) as resp:
            assert resp.status_code == 200
            resp.read()
            allowed = int(resp.headers["x-loongsage-max-new-tokens"])
        record = router.blocking.get(f"big-{protocol}")
        assert allowed == context - record.turns[-1].prompt_tokens - 1  # the engine needs one more position
        assert record.turns[-1].completion_tokens <= allowed


@pytest.mark.parametrize("protocol", ["chat", "responses", "anthropic"])
def test_tool_choice_none_offers_no_tools_and_shows_no_call(tool_engine_url, router_factory, renderer, protocol):
    """``none``: the prompt carries no tool schemas and the call the model writes anyway never
    shows, as a call or as text (forced calls and structured output: test_constrained_decoding)."""
    router = router_factory([tool_engine_url], [ToolCallParser("hermes")])
    url = router.blocking.register(f"none-{protocol}", sampling={"max_new_tokens": 16})
    path, body = request_body(protocol, False, True, None)
    body["tool_choice"] = {"type": "none"} if protocol == "anthropic" else "none"
    resp = httpx.post(url + path, json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    record = router.blocking.pop(f"none-{protocol}")
    prompt = renderer.decode(record.segments[0].tokens[:record.turns[0].prompt_tokens])
    assert "<tools>" not in prompt and '"add"' not in prompt
    assert "<tool_call>" in renderer.decode(record.segments[0].tokens)  # the model wrote one anyway ...
    text = json.dumps(resp.json())
    for shown in ("<tool_call>", '"tool_calls"', '"function_call"', '"tool_use"'):
        assert shown not in text, shown  # ... unseen


def test_an_anthropic_prefill_continues_the_assistant_turn(markov_engine_url, router_factory, renderer, tokenizer,
                                                           shapes):
    """A request ending with an assistant message continues that message: its text is the end of
    the prompt (loss mask 0, the turn not closed), the model's tokens follow it (mask 1) and the
    answer holds only the continuation; the next turn extends the same segment."""
    router = router_factory([markov_engine_url])
    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    prompt = renderer.prompt_tokens(prefill, continue_final=True)
    assert renderer.decode(prompt).endswith("<|im_start|>assistant\nThe answer is")
    firsts = set()
    for seed, stream in ((1, False), (2, True), (3, False), (4, True)):
        url = router.blocking.register(f"prefill-{seed}", sampling={"seed": seed, "max_new_tokens": 12})
        answer = run_turn(shapes, url, "anthropic", stream, messages=prefill)
        record = router.blocking.get(f"prefill-{seed}")
        seg = record.segments[0]
        n = len(prompt)
        assert seg.tokens[:n] == prompt and seg.loss_mask == [0] * n + [1] * (len(seg.tokens) - n)
        generated_ids = seg.tokens[n:]
        assert answer["text"] == renderer.content_of(generated_ids)
        firsts.add(renderer.decode(generated_ids[:1]))
        assert record.messages[-1]["content"] == "The answer is" + answer["text"]
        # the agent sends the whole answer back with a new question: the same segment goes on
        messages = [prefill[0], {"role": "assistant", "content": "The answer is" + answer["text"]},
                    {"role": "user", "content": "more"}]
        run_turn(shapes, url, "anthropic", stream, messages=messages)
        record = router.blocking.pop(f"prefill-{seed}")
        assert len(record.segments) == 1 and len(record.turns) == 2
    assert firsts == {" ok", " "}  # the model went on from " is" (after a new turn's "\n" it writes other tokens)
