"""The router over HTTP with the official OpenAI SDK and real embedded engines."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from loongsage_core.agentflow import RouterClient, TrajectoryRecord

TOOLS = [{"type": "function", "function": {"name": "add", "description": "add numbers",
                                            "parameters": {"type": "object",
                                                           "properties": {"a": {"type": "integer"}}}}}]


def engine_generate(url: str, input_ids: list[int], sampling: dict) -> dict:
    resp = httpx.post(f"{url}/generate", json={"input_ids": input_ids, "sampling_params": sampling,
                                               "return_logprob": True}, timeout=60)
    resp.raise_for_status()
    return resp.json()


def engine_state(url: str) -> dict:
    """The embedded engine's scheduler counters (running, waiting, generated_tokens, ...)."""
    return httpx.get(url + "/get_server_info", trust_env=False).json()["internal_states"][0]


def spans(mask: list[int], value: int) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate(list(mask) + [1 - value]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            out.append((start, i))
            start = None
    return out


def test_chat_records_exactly_what_the_engine_generated(engine_url, router_factory, renderer):
    router = router_factory([engine_url])
    url = router.blocking.register("traj-1", sampling={"temperature": 1.0, "max_new_tokens": 16, "seed": 11})
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    resp = client.chat.completions.create(model="policy", messages=messages)
    record = router.blocking.pop("traj-1")
    seg = record.segments[0]
    prompt = renderer.prompt_tokens(messages)
    assert seg.tokens[:len(prompt)] == prompt and seg.loss_mask[:len(prompt)] == [0] * len(prompt)
    generated = seg.tokens[len(prompt):]
    assert seg.loss_mask[len(prompt):] == [1] * len(generated)
    # the same request sent straight to the engine gives the same tokens and log-probs
    direct = engine_generate(engine_url, prompt, {"temperature": 1.0, "max_new_tokens": 16, "sampling_seed": 11,
                                                  "stop_token_ids": list(renderer.turn_end_ids)})
    assert generated == direct["output_ids"]
    lps = [e[0] for e in direct["meta_info"]["output_token_logprobs"]]
    assert seg.logprobs[len(prompt):] == pytest.approx(lps, abs=1e-5)
    assert seg.weight_versions[len(prompt):] == [0] * len(generated)
    assert resp.usage.completion_tokens == len(generated) and resp.usage.prompt_tokens == len(prompt)
    assert resp.choices[0].message.content == renderer.content_of(generated)
    expected_finish = "length" if direct["meta_info"]["finish_reason"]["type"] == "length" else "stop"
    assert resp.choices[0].finish_reason == expected_finish == record.finish_reason
    assert record.messages[-1]["content"] == resp.choices[0].message.content
    assert record.turns[0].new_segment and record.turns[0].completion_tokens == len(generated)


def test_multi_turn_tool_conversation_is_token_exact(tool_engine_url, router_factory, renderer, tool_call):
    from loongsage_plugin_agents.tool_parser import ToolCallParser

    router = router_factory([tool_engine_url], [ToolCallParser("hermes")])
    url = router.blocking.register("tools-1", sampling={"temperature": 1.0, "max_new_tokens": 32})
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    messages: list[dict] = [{"role": "user", "content": "What is 1+2?"}]
    for turn in range(2):
        resp = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments) == {}
        messages.append(choice.message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"result {turn}"})
    messages.append({"role": "user", "content": "Thanks. Once more?"})
    stream = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert [d.tool_calls[0].function.name for d in deltas if d.tool_calls] == ["add"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(tool_call["pieces"])
    record = router.blocking.pop("tools-1")
    assert len(record.segments) == 1 and len(record.turns) == 3
    seg = record.segments[0]
    ones = spans(seg.loss_mask, 1)
    assert ones == [tuple(t) for t in seg.turns] and len(ones) == 3
    # every generated span is what the engine produces for the context before it
    for start, end in ones:
        params = {"temperature": 1.0, "max_new_tokens": 32, "stop_token_ids": list(renderer.turn_end_ids)}
        direct = engine_generate(tool_engine_url, seg.tokens[:start], params)
        assert seg.tokens[start:end] == direct["output_ids"]
        assert renderer.decode(direct["output_ids"]) == tool_call["text"] + "<|im_end|>"
    # everything else is the template's own tokenization of the other messages
    for start, end in spans(seg.loss_mask, 0):
        assert renderer.encode(renderer.decode(seg.tokens[start:end])) == seg.tokens[start:end]
    # ... i.e. the conversation as rendered by the template, except that each model turn is the
    # model's own text (its tool-call syntax), not the template's re-rendering of the parsed call
    as_generated = [{"role": "assistant", "content": tool_call["text"]} if m["role"] == "assistant" else m
                    for m in messages + [record.messages[-1]]]
    assert renderer.decode(seg.tokens) + "\n" == renderer.render(as_generated, TOOLS, add_generation_prompt=False)
    assert "<tool_response>\nresult 1\n</tool_response>" in renderer.decode(seg.tokens)


def test_streaming_matches_the_record(engine_url, router_factory, renderer):
    router = router_factory([engine_url])
    url = router.blocking.register("stream-1", sampling={"max_new_tokens": 12, "seed": 5})
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    chunks = list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    record = router.blocking.pop("stream-1")
    generated = [t for t, m in zip(record.segments[0].tokens, record.segments[0].loss_mask) if m]
    assert text == renderer.content_of(generated)
    assert chunks[-1].usage.completion_tokens == len(generated)
    assert all(c.id == chunks[0].id for c in chunks)


def test_requests_extend_the_record_or_start_a_new_segment(engine_url, router_factory):
    router = router_factory([engine_url])
    url = router.blocking.register("seg-1", sampling={"max_new_tokens": 6, "seed": 1})
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    msgs = [{"role": "user", "content": "one"}]
    a = client.chat.completions.create(model="m", messages=msgs)
    msgs += [{"role": "assistant", "content": a.choices[0].message.content}, {"role": "user", "content": "two"}]
    client.chat.completions.create(model="m", messages=msgs)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "compacted history"}])
    record = router.blocking.pop("seg-1")
    assert [t.segment for t in record.turns] == [0, 0, 1]
    assert [t.new_segment for t in record.turns] == [True, False, True]
    assert len(record.segments) == 2 and all(s.trainable for s in record.segments)


def test_invalid_requests_get_openai_errors(engine_url, router_factory):
    router = router_factory([engine_url])
    url = router.blocking.register("err-1")
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=msgs, extra_body={"bogus_field": 1})
    assert info.value.status_code == 400
    assert info.value.body == {"message": "Unrecognized request argument supplied: bogus_field",
                               "type": "invalid_request_error", "param": "bogus_field", "code": "unknown_parameter"}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=msgs, n=2)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=msgs, temperature=7)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "robot", "content": "x"}])
    assert info.value.body["param"] == "messages[0].role"
    raw = httpx.post(f"{url}/chat/completions", content=b'{"messages": [', headers={"Content-Type": "application/json"})
    assert raw.status_code == 400
    err = raw.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["code"] == "invalid_json"
    # unknown trajectory, stale attempt, unknown path: 404 in the same error shape
    other = openai.OpenAI(base_url=url.replace("/err-1/", "/nope/"), api_key="k", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        other.chat.completions.create(model="m", messages=msgs)
    assert info.value.body["code"] == "trajectory_not_found" and info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        other.models.list()
    stale = openai.OpenAI(base_url=url.replace("/err-1/0/", "/err-1/1/"), api_key="k", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        stale.chat.completions.create(model="m", messages=msgs)
    assert info.value.body["code"] == "stale_attempt"
    assert httpx.get(router.base_url + "/nowhere").json()["error"]["code"] == "not_found"
    assert [m.id for m in client.models.list()] == ["policy"]
    assert router.blocking.get("err-1").turns == []  # nothing was recorded by failed requests


def test_budgets_end_turns_with_length(engine_url, router_factory, renderer):
    # ignore_eos and a rare turn-end token: the random model writes until a limit stops it
    router = router_factory([engine_url], turn_end_ids=[511])
    sampling = {"max_new_tokens": 50, "seed": 4, "ignore_eos": True}
    url = router.blocking.register("budget-1", sampling=sampling, max_response_tokens=7)
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    msgs = [{"role": "user", "content": "go"}]
    first = client.chat.completions.create(model="m", messages=msgs)
    assert first.usage.completion_tokens == 7 and first.choices[0].finish_reason == "length"
    calls = router.blocking.stats()["engine_calls"]
    msgs += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "more"}]
    second = client.chat.completions.create(model="m", messages=msgs)
    assert second.choices[0].finish_reason == "length" and second.usage.completion_tokens == 0
    assert second.choices[0].message.content == ""
    assert router.blocking.stats()["engine_calls"] == calls  # no generation once the budget is spent
    assert router.blocking.pop("budget-1").response_tokens == 7
    # context budget: prompt + generation never exceeds max_context_length
    prompt_len = len(renderer.prompt_tokens([{"role": "user", "content": "go"}]))
    url = router.blocking.register("budget-2", sampling=sampling, max_context_length=prompt_len + 3)
    resp = openai.OpenAI(base_url=url, api_key="k", max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "go"}])
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"
    assert len(router.blocking.pop("budget-2").segments[0].tokens) == prompt_len + 3


def test_admin_api_over_http(engine_url, router_factory):
    router = router_factory([engine_url])
    admin = RouterClient(router.base_url)
    url = admin.blocking.register("adm-1", sampling={"max_new_tokens": 4}, metadata={"k": 1}, priority=-3)
    assert url == router.url_for("adm-1")
    assert router.registry.entry("adm-1").priority == -3  # sent with each of its engine calls
    openai.OpenAI(base_url=url, api_key="k", max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}])
    record = admin.blocking.pop("adm-1")
    assert isinstance(record, TrajectoryRecord) and record.metadata == {"k": 1}
    assert record.segments[0].trainable and record.status.value == "generating"
    assert TrajectoryRecord.from_dict(record.to_dict()) == record
    bad = httpx.post(router.base_url + "/admin/trajectories", json={"trajectory_id": "a/b"})
    assert bad.status_code == 400 and "'/'" in bad.json()["error"]["message"]
    bad = httpx.post(router.base_url + "/admin/trajectories", json={"trajectory_id": "p", "priority": "high"})
    assert bad.status_code == 400 and "priority must be an integer" in bad.json()["error"]["message"]
    assert httpx.delete(router.base_url + "/admin/trajectories/adm-1").status_code == 404


def test_an_abort_while_a_turn_is_planned_is_kept(engine_url, router_factory):
    """The host aborts while the router renders a turn (the window between the request's first
    check and generation): the request gets 409 and the record stays ``aborted``, not
    ``generating`` (the runner reports such a trajectory aborted, not failed)."""
    router = router_factory([engine_url])
    url = router.blocking.register("plan-abort", sampling={"max_new_tokens": 4})
    planned = router.turns._plan

    async def plan_then_abort(entry, *args, **kwargs):
        plan = await planned(entry, *args, **kwargs)
        router.registry.abort(entry.record.trajectory_id)  # on the router's loop, as admin calls run
        return plan

    router.turns._plan = plan_then_abort
    with pytest.raises(openai.ConflictError, match="was aborted"):
        openai.OpenAI(base_url=url, api_key="k", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}])
    record = router.blocking.pop("plan-abort")
    assert record.status.value == "aborted" and not record.turns


def test_sticky_and_least_loaded_engines(engine_url, tool_engine_url, router_factory):
    router = router_factory([engine_url, tool_engine_url])
    for i in range(4):
        url = router.blocking.register(f"lb-{i}", sampling={"max_new_tokens": 3, "seed": i})
        client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
        msgs = [{"role": "user", "content": "a"}]
        r = client.chat.completions.create(model="m", messages=msgs)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "b"}]
        client.chat.completions.create(model="m", messages=msgs)
    engines = []
    for i in range(4):
        turns = router.blocking.pop(f"lb-{i}").turns
        assert len({t.engine for t in turns}) == 1  # sticky: one engine per trajectory
        engines.append(turns[0].engine)
    assert sorted(engines) == sorted([engine_url, tool_engine_url] * 2)  # spread over both


def _paused_mid_turn(engine_url: str, router: Any, name: str) -> tuple[Any, Any]:
    """One 300-token chat turn through the router, the engine paused (abort mode) and continued
    while it decodes; returns the response and the popped trajectory."""
    url = router.blocking.register(name, sampling={"max_new_tokens": 300, "seed": 4, "ignore_eos": True})
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    result: dict = {}

    def call() -> None:
        result["resp"] = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "long"}])

    before = engine_state(engine_url)["generated_tokens"]  # a counter since the engine started
    worker = threading.Thread(target=call)
    worker.start()
    # pause once the engine is decoding the request (observed, not guessed with a sleep)
    deadline = time.monotonic() + 60
    while engine_state(engine_url)["generated_tokens"] == before:
        assert worker.is_alive() and time.monotonic() < deadline, "the request never started decoding"
        time.sleep(0.01)
    httpx.post(f"{engine_url}/pause_generation", json={"mode": "abort"}).raise_for_status()
    httpx.post(f"{engine_url}/continue_generation", json={}).raise_for_status()
    worker.join(300)  # popping a trajectory still in flight would abort it: wait until the call returned
    assert not worker.is_alive(), "the resumed call did not return"
    return result["resp"], router.blocking.pop(name)


def test_engine_abort_mid_turn_is_resumed(engine_url, router_factory):
    router = router_factory([engine_url], turn_end_ids=[511])
    # seed 4 with ignore_eos runs the whole 300 tokens (about a second): long enough to interrupt,
    # unless a loaded machine keeps this thread waiting until the turn ended; then the pause met
    # nothing (no continuation) and the turn is tried again
    for attempt in range(5):
        resp, record = _paused_mid_turn(engine_url, router, f"pause-{attempt}")
        [turn] = record.turns
        if turn.continuations:
            break
    assert turn.continuations >= 1, "every turn ended before the pause reached the engine"
    seg = record.segments[0]
    assert len(seg.turns) == 1  # one model turn, even though it was generated in pieces
    assert resp.usage.completion_tokens == seg.num_generated == turn.completion_tokens
    assert turn.finish_reason == "length" and turn.completion_tokens == 300


def test_stop_strings_cut_the_turn(tool_engine_url, router_factory, renderer, tool_call):
    router = router_factory([tool_engine_url])
    url = router.blocking.register("stop-1", sampling={"max_new_tokens": 32})
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    msgs = [{"role": "user", "content": "go"}]
    resp = client.chat.completions.create(model="m", messages=msgs, stop=["add", '"name"'])
    assert resp.choices[0].message.content == "<tool_call>{" and resp.choices[0].finish_reason == "stop"
    seg = router.blocking.get("stop-1").segments[0]
    generated = [t for t, m in zip(seg.tokens, seg.loss_mask) if m]
    assert renderer.decode(generated) == '<tool_call>{"name":'  # up to the token that completed the stop
    msgs += [{"role": "assistant", "content": "<tool_call>{"}, {"role": "user", "content": "again"}]
    client.chat.completions.create(model="m", messages=msgs)
    seg = router.blocking.pop("stop-1").segments[0]
    first_end = seg.turns[0][1]
    # the cut turn is closed by the template's turn end, as prompt text (mask 0)
    closing = renderer.decode(seg.tokens[first_end:seg.turns[1][0]])
    assert closing.startswith("<|im_end|>\n<|im_start|>user\nagain")
    assert seg.loss_mask[first_end:seg.turns[1][0]] == [0] * (seg.turns[1][0] - first_end)


class Marker:
    """A middleware written for this test: tags requests and responses with its name."""

    def __init__(self, name: str, seen: list) -> None:
        self.name, self.seen = name, seen

    def on_request(self, trajectory_id, request):
        self.seen.append(("request", self.name))
        if self.name == "first":  # inject a system prompt: the recorded tokens must show it
            request = {**request, "messages": [{"role": "system", "content": "injected"}] + request["messages"]}
        return request

    def on_response(self, trajectory_id, request, response):
        self.seen.append(("response", self.name))
        response["choices"][0]["message"]["content"] += f"[{self.name}]"
        return response


def test_middleware_runs_in_configured_order(engine_url, router_factory, renderer, tmp_path):
    from loongsage_plugin_agents.request_logger import RequestLogger

    seen: list = []
    log = tmp_path / "requests.jsonl"
    router = router_factory([engine_url], [Marker("first", seen), Marker("second", seen), RequestLogger(str(log))])
    url = router.blocking.register("mw-1", sampling={"max_new_tokens": 3})
    resp = openai.OpenAI(base_url=url, api_key="k", max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}])
    assert seen == [("request", "first"), ("request", "second"), ("response", "first"), ("response", "second")]
    assert resp.choices[0].message.content.endswith("[first][second]")
    record = router.blocking.pop("mw-1")
    assert renderer.decode(record.segments[0].tokens).startswith("<|im_start|>system\ninjected<|im_end|>")
    assert record.messages[-1]["content"] == resp.choices[0].message.content
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["event"] for e in events] == ["request", "response"]
    assert events[0]["body"]["messages"][0]["content"] == "injected"  # logged after the earlier middleware
