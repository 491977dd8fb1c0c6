"""Constrained decoding through the real router and real embedded engines: forced tool calls
(``tool_choice`` ``required`` / a named function) and structured output (``response_format``,
Responses ``text.format``, Anthropic ``output_config.format``) are enforced in every protocol; the
engine's log-probs are those of the restricted distribution it sampled; the record keeps the
grammar so the trainer scores the same distribution (a training run's ``train/is_approx_k3_kl``
on constrained turns stays at the free turns' level).

The ``markov_engine_url`` model writes random walks over a handful of tokens (text, ``<think>``,
``<tool_call>``): left alone it rarely writes a valid call and never JSON, so every valid answer
below is the constraint's doing.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import httpx
import jsonschema
import pytest
from loongsage_plugin_agents.tool_parser import ToolCallParser

from loongsage_core.grammar import token_grammar

PARAMETERS = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"],
              "additionalProperties": False}
TOOLS = {
    "chat": [{"type": "function", "function": {"name": n, "parameters": PARAMETERS}} for n in ("add", "mul")],
    "responses": [{"type": "function", "name": n, "parameters": PARAMETERS} for n in ("add", "mul")],
    "anthropic": [{"name": n, "input_schema": PARAMETERS} for n in ("add", "mul")],
}
REQUIRED = {"chat": "required", "responses": "required", "anthropic": {"type": "any"}}
NAMED = {"chat": {"type": "function", "function": {"name": "mul"}}, "responses": {"type": "function", "name": "mul"},
         "anthropic": {"type": "tool", "name": "mul"}}
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2]}},
          "required": ["ok", "n"], "additionalProperties": False}
STRUCTURED = {"chat": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ANSWER}}},
              "responses": {"text": {"format": {"type": "json_schema", "name": "x", "schema": ANSWER, "strict": True}}},
              "anthropic": {"output_config": {"format": {"type": "json_schema", "schema": ANSWER}}}}
PATHS = {"chat": "/chat/completions", "responses": "/responses", "anthropic": "/messages"}


def body_of(protocol: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "hi"}]
    body: dict[str, Any] = {"model": "p", "max_tokens": 120}
    if protocol == "responses":
        body = {"model": "p", "input": messages, "max_output_tokens": 120}
    else:
        body["messages"] = messages
    return {**body, **copy.deepcopy(extra)}


def answer_of(protocol: str, obj: dict[str, Any]) -> tuple[str, list[tuple[str, Any]]]:
    """The answer's text and its tool calls ``(name, arguments)``."""
    if protocol == "chat":
        message = obj["choices"][0]["message"]
        return message["content"] or "", [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                          for c in message.get("tool_calls") or []]
    if protocol == "responses":
        text = "".join(p["text"] for i in obj["output"] if i["type"] == "message" for p in i["content"])
        return text, [(i["name"], json.loads(i["arguments"])) for i in obj["output"] if i["type"] == "function_call"]
    text = "".join(b["text"] for b in obj["content"] if b["type"] == "text")
    return text, [(b["name"], b["input"]) for b in obj["content"] if b["type"] == "tool_use"]


def replayed_ok(tokenizer: Any, segment: Any) -> None:
    """Every constrained token of ``segment`` was one its grammar allowed (the record's span replayed)."""
    assert segment.constraints, "the constrained turn keeps its grammar in the record"
    grammar = token_grammar(tokenizer, len(tokenizer))
    for span in segment.constraints:
        assert (span.start, span.end) in segment.turns
        tokens = segment.tokens[span.start:span.end]
        allowed = grammar.replay(span.grammar, tokens, span.stop_token_ids)
        assert all(bool(allowed[j, t]) for j, t in enumerate(tokens))


@pytest.mark.parametrize("protocol", ["chat", "responses", "anthropic"])
def test_forced_calls_and_structured_output_are_enforced(markov_engine_url, router_factory, tokenizer, protocol):
    router = router_factory([markov_engine_url], [ToolCallParser("hermes")])
    for seed in range(3):
        tid = f"{protocol}-{seed}"
        url = router.blocking.register(tid, sampling={"seed": seed})
        resp = httpx.post(url + PATHS[protocol], json=body_of(protocol, tools=TOOLS[protocol],
                                                               tool_choice=REQUIRED[protocol]), timeout=60)
        assert resp.status_code == 200, resp.text
        text, calls = answer_of(protocol, resp.json())
        assert calls and all(name in ("add", "mul") and args["a"] in (1, 2, 3) for name, args in calls), text
        resp = httpx.post(url + PATHS[protocol], json=body_of(protocol, tools=TOOLS[protocol],
                                                               tool_choice=NAMED[protocol]), timeout=60)
        assert resp.status_code == 200, resp.text
        text, calls = answer_of(protocol, resp.json())
        assert len(calls) == 1 and calls[0][0] == "mul" and calls[0][1]["a"] in (1, 2, 3), text
        resp = httpx.post(url + PATHS[protocol], json=body_of(protocol, **STRUCTURED[protocol]), timeout=60)
        assert resp.status_code == 200, resp.text
        text, calls = answer_of(protocol, resp.json())
        jsonschema.validate(json.loads(text), ANSWER)
        assert not calls
        record = router.blocking.pop(tid)
        assert len(record.turns) == 3
        for segment in record.segments:
            replayed_ok(tokenizer, segment)


def test_a_free_turn_records_no_grammar_and_json_object_gives_an_object(markov_engine_url, router_factory):
    router = router_factory([markov_engine_url], [ToolCallParser("hermes")])
    url = router.blocking.register("free")
    resp = httpx.post(url + "/chat/completions", json=body_of("chat", max_tokens=12), timeout=60)
    assert resp.status_code == 200, resp.text
    resp = httpx.post(url + "/chat/completions", json=body_of(
        "chat", response_format={"type": "json_object"}, max_tokens=300,
        messages=[{"role": "user", "content": "json please"}]), timeout=60)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # cut at the token limit: what was written is the start of an object
        assert choice["message"]["content"].startswith("{")
    record = router.blocking.pop("free")
    spans = [(s, c) for s, seg in enumerate(record.segments) for c in seg.constraints]
    assert len(spans) == 1 and record.segments[spans[0][0]].turns[-1] == (spans[0][1].start, spans[0][1].end)


def test_what_cannot_be_enforced_is_a_clear_400(markov_engine_url, router_factory):
    bare = router_factory([markov_engine_url])  # no middleware knows how the model writes a call
    url = bare.blocking.register("bare")
    resp = httpx.post(url + "/chat/completions", json=body_of("chat", tools=TOOLS["chat"], tool_choice="required"),
                      timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice", resp.text
    assert "tool_call_parser" in resp.json()["error"]["message"]
    parsed = router_factory([markov_engine_url], [ToolCallParser("hermes")])
    url = parsed.blocking.register("bad")
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    for extra, param in (({"response_format": bad_schema}, "response_format"),
                         ({"response_format": {"type": "xml"}}, "response_format.type"),
                         ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
                          "response_format.json_schema.name"),
                         ({"tools": TOOLS["chat"], "tool_choice": {"type": "function", "function": {"name": "div"}}},
                          "tool_choice")):
        resp = httpx.post(url + "/chat/completions", json=body_of("chat", **extra), timeout=60)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    resp = httpx.post(url + "/responses", json=body_of("responses", text={"format": {"type": "json_schema"}}),
                      timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "text.format.json_schema.name", resp.text
    assert parsed.blocking.pop("bad").turns == [] and bare.blocking.pop("bare").turns == []


def test_the_engine_reports_log_probs_of_the_restricted_distribution(tokenizer):
    """The engine's log-prob of a constrained token is ``log_softmax`` of the masked logits (what the
    trainer computes replaying the grammar), not of the raw ones; a grammar that does not compile
    and a resumed turn whose earlier tokens break it are 400s naming the field."""
    import torch
    from loongsage_plugin_torch.engine.engine import EmbeddedEngine
    from loongsage_plugin_torch.modeling import TINY_QWEN3, load_model

    from loongsage_core.config import structure_job
    from loongsage_core.grammar import compile_grammar, mask_logits
    from loongsage_hookspecs import EngineContext

    job = structure_job({"model": {"config": dict(TINY_QWEN3), "tokenizer": str(tokenizer.name_or_path)},
                         "rollout": {"max_context_length": 256}, "run": {"seed": 0}})
    model = load_model(job)
    engine = EmbeddedEngine(EngineContext(job=job, components=None), model=model)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    stops = tokenizer.convert_tokens_to_ids(["<|im_end|>"])
    url = engine.start()
    try:
        sampling = {"regex": "(ab|cd)+e", "max_new_tokens": 24, "stop_token_ids": stops, "seed": 3}
        out = httpx.post(url + "/generate", json={"input_ids": prompt, "sampling_params": sampling,
                                                  "return_logprob": True}, timeout=60).json()
        triples = out["meta_info"]["output_token_logprobs"]
        ids, engine_lp = [t[1] for t in triples], torch.tensor([t[0] for t in triples])
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
        allowed = token_grammar(tokenizer, logits.shape[-1]).replay(compile_grammar("regex", sampling["regex"]),
                                                                    ids, stops)
        masked = torch.log_softmax(mask_logits(logits, allowed), -1)[torch.arange(len(ids)), ids]
        raw = torch.log_softmax(logits, -1)[torch.arange(len(ids)), ids]
        assert torch.allclose(engine_lp, masked, atol=1e-4)
        assert (masked - raw).mean() > 1.0  # what an unconstrained trainer would have seen instead
        bad = httpx.post(url + "/generate", json={"input_ids": prompt, "sampling_params": {"json_schema": "{x"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.json_schema"
        resumed = {**sampling, "custom_params": {"grammar_offset": 2}}  # "\n" of the prompt is not "ab"/"cd"
        bad = httpx.post(url + "/generate", json={"input_ids": prompt, "sampling_params": resumed})
        assert bad.status_code == 400 and "grammar_offset" in bad.json()["error"]["param"], bad.text
        # a turn resumed after an abort: its first tokens are the prompt's last ones, the grammar goes on
        done = tokenizer.encode("abcd", add_special_tokens=False)
        resumed = {**sampling, "custom_params": {"grammar_offset": len(done)}}
        out = httpx.post(url + "/generate", json={"input_ids": prompt + done, "sampling_params": resumed},
                         timeout=60).json()
        assert re.fullmatch("(ab|cd)+e", "abcd" + out["text"]), out["text"]
    finally:
        engine.shutdown()
