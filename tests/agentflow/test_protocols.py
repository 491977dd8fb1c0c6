"""The three agent protocols (Chat Completions, Responses, Anthropic Messages) against the real
router and real embedded engines, through the official ``openai`` and ``anthropic`` SDKs."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

TOOLS = [{"type": "function", "function": {"name": "add", "description": "add numbers",
                                            "parameters": {"type": "object",
                                                           "properties": {"a": {"type": "integer"}}}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "add", "description": "add numbers",
                    "parameters": TOOLS[0]["function"]["parameters"]}]
ANTHROPIC_TOOLS = [{"name": "add", "description": "add numbers", "input_schema": TOOLS[0]["function"]["parameters"]}]


def engine_generate(url: str, input_ids: list[int], sampling: dict) -> dict:
    resp = httpx.post(f"{url}/generate", json={"input_ids": input_ids, "sampling_params": sampling,
                                               "return_logprob": True}, timeout=60)
    resp.raise_for_status()
    return resp.json()


def generated(record) -> list[int]:
    seg = record.segments[-1]
    return [t for t, m in zip(seg.tokens, seg.loss_mask) if m]


def anthropic_client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="k", max_retries=0)


# ------------------------------------------------------------------------------- Chat Completions
def test_chat_top_logprobs_come_from_the_engine(engine_url, router_factory, renderer):
    router = router_factory([engine_url])
    url = router.blocking.register("c-top", sampling={"max_new_tokens": 6, "seed": 2})
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    resp = client.chat.completions.create(model="p", messages=messages, logprobs=True, top_logprobs=3)
    prompt = renderer.prompt_tokens(messages)
    direct = httpx.post(f"{engine_url}/generate", json={
        "input_ids": prompt, "return_logprob": True, "top_logprobs_num": 3,
        "sampling_params": {"max_new_tokens": 6, "sampling_seed": 2, "stop_token_ids": list(renderer.turn_end_ids)}},
        timeout=60).json()
    ids = direct["output_ids"]
    shown = ids[:-1] if ids and ids[-1] in renderer.turn_end_ids else ids
    content = resp.choices[0].logprobs.content
    assert [c.token for c in content] == [renderer.decode([t]) for t in shown]
    for entry, row in zip(content, direct["meta_info"]["output_top_logprobs"]):
        assert [t.token for t in entry.top_logprobs] == [renderer.decode([t]) for _, t, _ in row]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([lp for lp, _, _ in row], abs=1e-5)
    assert generated(router.blocking.pop("c-top")) == ids


# ------------------------------------------------------------------------------------- Responses
def test_responses_text_is_recorded_token_exact(engine_url, router_factory, renderer):
    router = router_factory([engine_url])
    url = router.blocking.register("r-1", sampling={"max_new_tokens": 12, "seed": 3})
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    resp = client.responses.create(model="policy", instructions="Be brief.", input="Say something.")
    record = router.blocking.pop("r-1")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    prompt = renderer.prompt_tokens(messages)
    seg = record.segments[0]
    assert seg.tokens[:len(prompt)] == prompt and seg.loss_mask == [0] * len(prompt) + [1] * (len(seg.tokens) -
                                                                                              len(prompt))
    direct = engine_generate(engine_url, prompt, {"max_new_tokens": 12, "sampling_seed": 3,
                                                  "stop_token_ids": list(renderer.turn_end_ids)})
    assert generated(record) == direct["output_ids"]
    assert resp.output_text == renderer.content_of(direct["output_ids"])
    assert resp.usage.input_tokens == len(prompt) and resp.usage.output_tokens == len(direct["output_ids"])
    assert resp.status in ("completed", "incomplete") and resp.output[0].type == "message"


def test_responses_stream_events(engine_url, router_factory, renderer):
    router = router_factory([engine_url])
    url = router.blocking.register("r-2", sampling={"max_new_tokens": 16, "seed": 9})
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    events = list(client.responses.create(model="policy", input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}], stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    record = router.blocking.pop("r-2")
    assert text == renderer.content_of(generated(record)) == events[-1].response.output_text
    if text:
        assert kinds.index("response.output_item.added") < kinds.index("response.content_part.added") < \
            kinds.index("response.output_text.delta") < kinds.index("response.output_text.done") < \
            kinds.index("response.output_item.done")
    # the SDK's own accumulating stream helper understands the events
    url = router.blocking.register("r-3", sampling={"max_new_tokens": 8, "seed": 9})
    with openai.OpenAI(base_url=url, api_key="k", max_retries=0).responses.stream(model="p", input="hi") as s:
        final = s.get_final_response()
    assert final.output_text == renderer.content_of(generated(router.blocking.pop("r-3")))


def test_responses_tool_round_trip(tool_engine_url, router_factory, renderer, tool_call):
    from loongsage_plugin_agents.tool_parser import ToolCallParser

    router = router_factory([tool_engine_url], [ToolCallParser("hermes")])
    url = router.blocking.register("r-tools", sampling={"max_new_tokens": 32})
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    first = client.responses.create(model="p", input="What is 1+2?", tools=RESPONSES_TOOLS)
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.name == "add" and json.loads(call.arguments) == {} and call.call_id.startswith("call_")
    # the result goes back with previous_response_id (the router's per-trajectory store) ...
    events = list(client.responses.create(model="p", previous_response_id=first.id, tools=RESPONSES_TOOLS,
                                          input=[{"type": "function_call_output", "call_id": call.call_id,
                                                  "output": "3"}], stream=True))
    kinds = [e.type for e in events]
    for kind in ("response.output_item.added", "response.function_call_arguments.delta",
                 "response.function_call_arguments.done", "response.output_item.done", "response.completed"):
        assert kind in kinds
    assert not any(e.type == "response.output_text.delta" for e in events)  # the call never shows as text
    second = events[-1].response
    [call2] = [o for o in second.output if o.type == "function_call"]
    # ... or as the whole conversation (what Codex does)
    third = client.responses.create(model="p", tools=RESPONSES_TOOLS, input=[
        {"type": "message", "role": "user", "content": "What is 1+2?"},
        call.model_dump(), {"type": "function_call_output", "call_id": call.call_id, "output": "3"},
        call2.model_dump(), {"type": "function_call_output", "call_id": call2.call_id, "output": "3 again"}])
    assert third.output[-1].type == "function_call"
    record = router.blocking.pop("r-tools")
    assert len(record.segments) == 1 and len(record.turns) == 3  # every turn extended the one segment
    text = renderer.decode(record.segments[0].tokens)
    assert "<tool_response>\n3\n</tool_response>" in text and "<tool_response>\n3 again\n</tool_response>" in text
    assert text.count(tool_call["text"]) == 3


def test_responses_bad_input_gets_openai_errors(engine_url, router_factory):
    router = router_factory([engine_url])
    url = router.blocking.register("r-bad", sampling={"max_new_tokens": 4})
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    cases = [
        ({"input": "x", "bogus": 1}, "bogus"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"type": "message", "role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]},
         "input[0].content[0].image_url"),
        ({"input": [{"type": "message", "role": "system", "content": [{"type": "input_image"}]}]},
         "input[0].content[0].type"),
        ({"input": "x", "previous_response_id": "resp_missing"}, "previous_response_id"),
        ({"input": "x", "previous_response_id": ["resp_1"]}, "previous_response_id"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.json_schema.name"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.post("/responses", body={"model": "p", **body}, cast_to=object)
        assert info.value.body["param"] == param, body
    resp = httpx.post(url + "/responses", content=b"{not json", timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json"


# ----------------------------------------------------------------------------- Anthropic Messages
def test_messages_text_stream_and_count_tokens(engine_url, router_factory, renderer):
    router = router_factory([engine_url])
    url = router.blocking.register("a-1", sampling={"max_new_tokens": 12, "seed": 5})
    client = anthropic_client(url)
    count = client.messages.count_tokens(model="p", system="Be brief.", messages=[{"role": "user", "content": "hi"}])
    msg = client.messages.create(model="p", max_tokens=12, system=[{"type": "text", "text": "Be brief."}],
                                 messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    prompt = renderer.prompt_tokens([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert count.input_tokens == len(prompt) == msg.usage.input_tokens
    record = router.blocking.pop("a-1")
    assert record.segments[0].tokens[:len(prompt)] == prompt
    text = renderer.content_of(generated(record))
    assert "".join(b.text for b in msg.content if b.type == "text") == text
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.usage.output_tokens == len(generated(record))
    # streaming, through the SDK's accumulating helper and as raw events
    url = router.blocking.register("a-2", sampling={"max_new_tokens": 12, "seed": 5})
    with anthropic_client(url).messages.stream(model="p", max_tokens=12,
                                               messages=[{"role": "user", "content": "hi"}]) as s:
        events = list(s)
        final = s.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    streamed = "".join(b.text for b in final.content if b.type == "text")
    assert streamed == renderer.content_of(generated(router.blocking.pop("a-2")))
    # HEAD / GET on the base URL answer while the trajectory is live
    router.blocking.register("a-3")
    assert httpx.head(url.removesuffix("/v1").replace("a-2", "a-3"), timeout=10).status_code == 200
    assert httpx.get(url.replace("a-2", "a-3"), timeout=10).status_code == 200


def test_messages_tool_round_trip(tool_engine_url, router_factory, renderer, tool_call):
    from loongsage_plugin_agents.tool_parser import ToolCallParser

    router = router_factory([tool_engine_url], [ToolCallParser("hermes")])
    url = router.blocking.register("a-tools", sampling={"max_new_tokens": 32})
    client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="k", max_retries=0,
                                 default_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"})
    messages: list[dict] = [{"role": "user", "content": "What is 1+2?"}]
    first = client.messages.create(model="p", max_tokens=32, tools=ANTHROPIC_TOOLS, messages=messages)
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "add" and use.input == {}
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "3"}]}]
    with client.messages.stream(model="p", max_tokens=32, tools=ANTHROPIC_TOOLS, messages=messages) as s:
        events = list(s)
        second = s.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    assert not any(e.type == "content_block_delta" and e.delta.type == "text_delta" for e in events)
    assert second.stop_reason == "tool_use" and second.content[-1].type == "tool_use"
    # the beta endpoint Claude Code calls
    resp = httpx.post(url + "/messages?beta=true", headers={"anthropic-version": "2023-06-01", "x-api-key": "k",
                                                            "anthropic-beta": "claude-code-20250219"},
                      json={"model": "p", "max_tokens": 32, "tools": ANTHROPIC_TOOLS, "messages": messages + [
                          {"role": "assistant", "content": [b.model_dump() for b in second.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": second.content[-1].id,
                                                        "content": [{"type": "text", "text": "3 again"}]}]}]},
                      timeout=60)
    assert resp.status_code == 200 and resp.json()["stop_reason"] == "tool_use"
    record = router.blocking.pop("a-tools")
    assert len(record.segments) == 1 and len(record.turns) == 3
    text = renderer.decode(record.segments[0].tokens)
    assert "<tool_response>\n3 again\n</tool_response>" in text and text.count(tool_call["text"]) == 3


def test_messages_bad_input_gets_anthropic_errors(engine_url, router_factory):
    router = router_factory([engine_url])
    url = router.blocking.register("a-bad", sampling={"max_new_tokens": 4})
    base = url + "/messages"
    user = [{"role": "user", "content": "hi"}]
    cases = [
        {"model": "p", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]},
        {"model": "p", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
        {"model": "p", "max_tokens": 4, "messages": user, "bogus": True},
        {"model": "p", "messages": user},
        {"model": "p", "max_tokens": 4, "messages": user, "tools": [{"type": "bash_20250124", "name": "bash"}]},
    ]
    for body in cases:
        resp = httpx.post(base, json=body, timeout=10)
        assert resp.status_code == 400, body
        err = resp.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    resp = httpx.post(base, content=b"{", timeout=10)
    assert resp.status_code == 400 and resp.json()["type"] == "error"
    resp = httpx.post(url.replace("a-bad", "nobody") + "/messages", json=cases[0], timeout=10)
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client(url).messages.create(model="p", max_tokens=4,
                                              messages=[{"role": "assistant", "content": [{"type": "document"}]}])


class SplitReasoning:
    """A middleware written for this test: the first half of the model's text is its reasoning."""

    def on_request(self, trajectory_id, request):
        return request

    def stream_holdback(self, request, text):
        return len(text)  # streams nothing early: the split point moves as text arrives

    def on_response(self, trajectory_id, request, response):
        message = response["choices"][0]["message"]
        text = message["content"] or ""
        message["reasoning_content"], message["content"] = text[:len(text) // 2], text[len(text) // 2:]
        return response


def test_reasoning_comes_out_as_reasoning_items_and_thinking_blocks(engine_url, router_factory, renderer):
    router = router_factory([engine_url], [SplitReasoning()], turn_end_ids=[511])
    sampling = {"max_new_tokens": 8, "seed": 4, "ignore_eos": True}
    url = router.blocking.register("think-r", sampling=sampling)
    events = list(openai.OpenAI(base_url=url, api_key="k", max_retries=0).responses.create(
        model="p", input="hi", stream=True))
    text = renderer.content_of(generated(router.blocking.pop("think-r")))
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text + final.output_text == text
    assert "".join(e.delta for e in events if e.type == "response.reasoning.delta") == text[:len(text) // 2]
    url = router.blocking.register("think-a", sampling=sampling)
    msg = anthropic_client(url).messages.create(model="p", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    text = renderer.content_of(generated(router.blocking.pop("think-a")))
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking + msg.content[1].text == text


# ------------------------------------------------------------------------------- all protocols
def over_context_request(protocol: str, text: str) -> tuple[str, dict]:
    if protocol == "chat":
        return "/chat/completions", {"model": "p", "messages": [{"role": "user", "content": text}]}
    if protocol == "responses":
        return "/responses", {"model": "p", "input": text}
    return "/messages", {"model": "p", "max_tokens": 8, "messages": [{"role": "user", "content": text}]}


@pytest.mark.parametrize("protocol", ["chat", "responses", "anthropic"])
def test_over_context_prompt_is_a_400_and_marks_the_trajectory(engine_url, router_factory, protocol):
    router = router_factory([engine_url])
    url = router.blocking.register(f"ctx-{protocol}", max_context_length=64)
    path, body = over_context_request(protocol, "word " * 200)
    for stream in (False, True):
        resp = httpx.post(url + path, json={**body, "stream": stream}, timeout=30)
        assert resp.status_code == 400, resp.text
        err = resp.json()
        if protocol == "anthropic":
            assert err["error"]["type"] == "invalid_request_error" and "context length" in err["error"]["message"]
        else:
            assert err["error"]["code"] == "context_length_exceeded"
    # the trajectory is over: a prompt that would fit is refused too, and the record stays failed
    path, short = over_context_request(protocol, "hi")
    resp = httpx.post(url + path, json=short, timeout=30)
    assert resp.status_code == 400 and "takes no more turns" in resp.text, resp.text
    record = router.blocking.pop(f"ctx-{protocol}")
    assert record.status.value == "failed" and record.error.startswith("context_length_exceeded")
    assert record.segments == [] and record.turns == [] and record.finish_reason == "context_length_exceeded"
    # at the boundary: a prompt that fills the limit is refused, one token of room generates one token
    path, body = over_context_request(protocol, "hello")
    url = router.blocking.register(f"edge-{protocol}", max_context_length=10**6, sampling={"max_new_tokens": 1})
    assert httpx.post(url + path, json=body, timeout=30).status_code == 200
    prompt_len = router.blocking.pop(f"edge-{protocol}").turns[0].prompt_tokens
    for limit, status in ((prompt_len, 400), (prompt_len + 1, 200)):
        url = router.blocking.register(f"edge-{protocol}", max_context_length=limit, sampling={"max_new_tokens": 5})
        resp = httpx.post(url + path, json=body, timeout=30)
        assert resp.status_code == status, (limit, resp.text)
        record = router.blocking.pop(f"edge-{protocol}")
        assert (record.response_tokens, record.status.value) == ((0, "failed") if status == 400 else (1, "generating"))


def text_event_times(url: str, path: str, body: dict, protocol: str) -> list[float]:
    """Arrival times of the text events of a streamed call, from the first event of the stream."""
    times: list[float] = []
    opened = 0.0
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            opened = opened or time.perf_counter()  # the turn was accepted: generation starts
            if protocol == "chat":
                is_text = bool(event["choices"] and event["choices"][0]["delta"].get("content"))
            elif protocol == "responses":
                is_text = event["type"] == "response.output_text.delta"
            else:
                is_text = event["type"] == "content_block_delta" and event["delta"]["type"] == "text_delta"
            if is_text:
                times.append(time.perf_counter() - opened)
    return times


@pytest.mark.parametrize("protocol", ["chat", "responses", "anthropic"])
def test_stream_arrives_as_it_is_generated(engine_url, router_factory, protocol):
    # a rare turn-end token and ignore_eos: the random model writes exactly max_new_tokens tokens
    router = router_factory([engine_url], turn_end_ids=[511])
    path, body = {"chat": ("/chat/completions", {"model": "p", "messages": [{"role": "user", "content": "go"}]}),
                  "responses": ("/responses", {"model": "p", "input": "go"}),
                  "anthropic": ("/messages", {"model": "p", "messages": [{"role": "user", "content": "go"}]})}[protocol]
    for n in (32, 128):
        url = router.blocking.register(f"s-{protocol}-{n}", sampling={"max_new_tokens": n, "seed": 1,
                                                                      "ignore_eos": True, "temperature": 0.0})
        times = text_event_times(url, path, {**body, "max_tokens": n} if protocol == "anthropic" else body, protocol)
        assert router.blocking.pop(f"s-{protocol}-{n}").turns[0].completion_tokens == n
        assert len(times) >= n // 2, (protocol, n, len(times))
        if n == 128:  # long enough to time: the first text came well before the last (a buffered
            # answer arrives at once, ratio ~1; a loaded machine may delay the first token a while)
            assert times[0] < 0.75 * times[-1], (protocol, times[0], times[-1])


def test_client_disconnect_aborts_the_generation(engine_url, router_factory):
    router = router_factory([engine_url], turn_end_ids=[511])
    url = router.blocking.register("gone", sampling={"max_new_tokens": 600, "ignore_eos": True})

    def aborted() -> int:
        return httpx.get(engine_url + "/get_server_info", timeout=10).json()["internal_states"][0]["aborted_requests"]

    before = aborted()
    with httpx.stream("POST", url + "/messages", json={"model": "p", "max_tokens": 600, "stream": True,
                                                       "messages": [{"role": "user", "content": "go"}]},
                      timeout=60) as resp:
        for line in resp.iter_lines():
            if "text_delta" in line:
                break  # hang up mid-generation
    deadline = time.time() + 30
    while aborted() == before and time.time() < deadline:
        time.sleep(0.1)
    assert aborted() == before + 1
    record = router.blocking.pop("gone")
    assert record.segments == [] and record.turns == []  # an unfinished turn is never recorded


def test_access_log_records_every_request(engine_url, router_factory, tmp_path):
    log = tmp_path / "access.jsonl"
    router = router_factory([engine_url], access_log_path=str(log))
    url = router.blocking.register("log-1", sampling={"max_new_tokens": 2})
    httpx.post(url + "/responses", json={"model": "p", "input": "hi"}, timeout=30)
    httpx.post(url + "/messages", json={"model": "p", "messages": []}, timeout=30)
    entries = router.access_log.entries()
    assert [(e["method"], e["path"].rsplit("/", 1)[-1], e["status"]) for e in entries] == [
        ("POST", "responses", 200), ("POST", "messages", 400)]
    assert all(e["ms"] > 0 for e in entries) and router.access_log.errors() == entries[1:]
    assert [json.loads(line)["status"] for line in log.read_text().splitlines()] == [200, 400]
    over_http = httpx.get(router.base_url + "/admin/access_log", timeout=10).json()["entries"]
    assert [e["status"] for e in over_http][:2] == [200, 400]


class Broken:
    """A middleware written for this test: fails on every response."""

    changes_response = False

    def on_request(self, trajectory_id, request):
        return request

    def on_response(self, trajectory_id, request, response):
        raise RuntimeError("broken middleware")


def test_a_failure_after_the_stream_started_is_reported_in_it(engine_url, router_factory):
    router = router_factory([engine_url], [Broken()])
    url = router.blocking.register("fail-mid", sampling={"max_new_tokens": 3})
    for path, body in (("/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/responses", {"input": "x"}),
                       ("/messages", {"max_tokens": 3, "messages": [{"role": "user", "content": "x"}]})):
        resp = httpx.post(url + path, json={"model": "p", "stream": True, **body}, timeout=60)
        assert resp.status_code == 200  # the header went out when the turn was accepted
        last = json.loads([line for line in resp.text.splitlines() if line.startswith("data: {")][-1][6:])
        if path == "/responses":
            assert last["type"] == "response.failed" and "broken middleware" in last["response"]["error"]["message"]
        elif path == "/messages":
            assert last["type"] == "error" and last["error"]["type"] == "api_error"
        else:
            assert "broken middleware" in last["error"]["message"]
    with pytest.raises(openai.APIError):
        list(openai.OpenAI(base_url=url, api_key="k", max_retries=0).chat.completions.create(
            model="p", messages=[{"role": "user", "content": "x"}], stream=True))
    # a streamed request is logged when its handler returns, which may be just after the client
    # has read the end of the stream: wait for the fourth entry
    deadline = time.monotonic() + 30
    while len(router.access_log.entries()) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [e["status"] for e in router.access_log.entries()] == [500] * 4
    assert router.blocking.pop("fail-mid").turns == []


# ------------------------------------------------------------------- token exactness, property
_TEXT = st.text(alphabet=st.sampled_from(list("abc xyz\n{}\":é中")), min_size=1, max_size=12)


@st.composite
def conversations(draw):
    """A client-side history: user turns, assistant turns with text and/or tool calls, tool results."""
    messages: list[dict] = [{"role": "user", "content": draw(_TEXT)}]
    for i in range(draw(st.integers(0, 2))):
        calls = [{"id": f"call_{i}_{j}", "type": "function",
                  "function": {"name": "add", "arguments": json.dumps({"a": draw(st.integers(0, 99))})}}
                 for j in range(draw(st.integers(0, 2)))]
        text = draw(st.one_of(st.none(), _TEXT)) if calls else draw(_TEXT)
        reasoning = draw(st.one_of(st.none(), _TEXT))
        messages.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {}),
                         **({"reasoning_content": reasoning} if reasoning else {})})
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": draw(_TEXT)} for c in calls]
        messages.append({"role": "user", "content": draw(_TEXT)})
    return messages


def as_protocol(protocol: str, messages: list[dict]) -> tuple[str, dict]:
    """The same conversation in the protocol's own request format."""
    if protocol == "chat":
        return "/chat/completions", {"model": "p", "messages": messages, "tools": TOOLS}
    if protocol == "responses":
        items: list[dict] = []
        for m in messages:
            if m["role"] == "assistant":
                if m.get("reasoning_content"):
                    items.append({"type": "reasoning", "id": "rs_1", "summary": [],
                                  "content": [{"type": "reasoning_text", "text": m["reasoning_content"]}]})
                if m.get("content"):
                    items.append({"type": "message", "role": "assistant",
                                  "content": [{"type": "output_text", "text": m["content"]}]})
                items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                           "arguments": c["function"]["arguments"]} for c in m.get("tool_calls", [])]
            elif m["role"] == "tool":
                items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
            else:
                items.append({"type": "message", "role": m["role"], "content": m["content"]})
        return "/responses", {"model": "p", "input": items, "tools": RESPONSES_TOOLS}
    out: list[dict] = []
    for m in messages:
        if m["role"] == "assistant":
            blocks = ([{"type": "thinking", "thinking": m["reasoning_content"], "signature": ""}]
                      if m.get("reasoning_content") else []) + (
                [{"type": "text", "text": m["content"]}] if m.get("content") else []) + [
                {"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": json.loads(c["function"]["arguments"])} for c in m.get("tool_calls", [])]
            out.append({"role": "assistant", "content": blocks})
        elif m["role"] == "tool":
            block = {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
            if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list):
                out[-1]["content"].append(block)
            else:
                out.append({"role": "user", "content": [block]})
        else:
            out.append({"role": "user", "content": m["content"]})
    return "/messages", {"model": "p", "max_tokens": 6, "messages": out, "tools": ANTHROPIC_TOOLS}


@pytest.mark.parametrize("protocol", ["chat", "responses", "anthropic"])
def test_recorded_tokens_are_generated_plus_template(engine_url, router_factory, renderer, protocol):
    router = router_factory([engine_url])
    sampling = {"max_new_tokens": 6, "temperature": 1.0, "seed": 7}
    counter = iter(range(10**6))

    @settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck),
              phases=(Phase.explicit, Phase.reuse, Phase.generate))  # each example runs two real turns
    @given(history=conversations(), follow_up=_TEXT, stream=st.booleans())
    def check(history, follow_up, stream):
        tid = f"prop-{protocol}-{next(counter)}"
        url = router.blocking.register(tid, sampling=sampling)
        path, body = as_protocol(protocol, history)
        assert httpx.post(url + path, json={**body, "stream": stream}, timeout=60).status_code == 200
        record = router.blocking.get(tid)
        answer = record.messages[-1]
        # turn 2: the client adds the model's answer (as it saw it) and a new user message
        history2 = history + [{"role": "assistant", "content": answer["content"]},
                              {"role": "user", "content": follow_up}]
        path, body = as_protocol(protocol, history2)
        assert httpx.post(url + path, json={**body, "stream": stream}, timeout=60).status_code == 200
        record = router.blocking.pop(tid)
        assert len(record.segments) == 1 and len(record.turns) == 2
        seg = record.segments[0]
        (s1, e1), (s2, e2) = seg.turns
        # mask 1 exactly on the tokens the engine generated for the context before them
        assert seg.loss_mask == [0] * s1 + [1] * (e1 - s1) + [0] * (s2 - e1) + [1] * (e2 - s2)
        for turn, (start, end) in enumerate(seg.turns):  # the router varies the seed per turn
            seed = (7 + turn * 0x9E3779B1) % 2**31
            direct = engine_generate(engine_url, seg.tokens[:start], {
                "max_new_tokens": 6, "temperature": 1.0, "sampling_seed": seed,
                "stop_token_ids": list(renderer.turn_end_ids)})
            assert seg.tokens[start:end] == direct["output_ids"]
            lps = [e[0] for e in direct["meta_info"]["output_token_logprobs"]]
            assert seg.logprobs[start:end] == pytest.approx(lps, abs=1e-4)
        # everything else is the template's rendering: the conversation, then the delta after the answer
        assert seg.tokens[:s1] == renderer.prompt_tokens(history, TOOLS)
        last = seg.tokens[e1 - 1]
        delta = renderer.delta_tokens(history + [answer], [{"role": "user", "content": follow_up}], TOOLS, last)
        assert seg.tokens[e1:s2] == delta

    check()



def test_messages_system_messages_between_turns_are_rendered_in_place(engine_url, router_factory, renderer):
    """Claude Code 2.1 sends ``system`` messages after its first user message (environment notes)."""
    router = router_factory([engine_url])
    url = router.blocking.register("a-midsys", sampling={"max_new_tokens": 2})
    body = {"model": "p", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "first"}]},
        {"role": "system", "content": [{"type": "text", "text": "cwd: /work"}]},
        {"role": "user", "content": "second"}]}
    resp = httpx.post(url + "/messages", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    record = router.blocking.pop("a-midsys")
    text = renderer.decode(record.segments[0].tokens)
    assert "<|im_start|>user\nfirst<|im_end|>\n<|im_start|>user\ncwd: /work<|im_end|>\n<|im_start|>user\nsecond" in text
