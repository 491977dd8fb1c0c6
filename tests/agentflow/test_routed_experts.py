"""The routing of a mixture-of-experts engine, recorded through the AgentFlow router (Router Replay).

A real embedded engine serves a tiny Qwen3-MoE; a router with ``return_routed_experts`` asks for
the experts of every token. Each segment then holds one record per token, equal to the top-k of
the model's routers computed here independently with transformers, over multi-turn
conversations, streamed turns, every protocol (chat completions, Responses, Anthropic Messages)
and a turn resumed after the engine aborted it mid-way (a partial rollout's continuation).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
import torch

from loongsage_core.agentflow import TrajectoryRecord

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "data" / "tokenizer"
TINY_MOE = dict(model_type="qwen3_moe", vocab_size=512, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0], num_hidden_layers=3,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
                tie_word_embeddings=True)
LAYERS, TOP_K = 3, 2


@pytest.fixture(scope="module")
def moe_engine() -> Iterator[tuple[str, Any]]:
    """A started engine serving the tiny Qwen3-MoE, and a transformers copy of the same weights."""
    from loongsage_plugin_torch.engine.engine import EmbeddedEngine
    from loongsage_plugin_torch.modeling import load_model

    from loongsage_core.config import structure_job
    from loongsage_hookspecs import EngineContext

    job = structure_job({"model": {"config": dict(TINY_MOE), "tokenizer": str(TOKENIZER_DIR), "seed": 11},
                         "rollout": {"max_context_length": 1024, "engine_args": {"num_threads": 1}},
                         "run": {"seed": 0}})
    engine = EmbeddedEngine(EngineContext(job=job, components=None))
    try:
        yield engine.start(), load_model(job).eval()
    finally:
        engine.shutdown()


def router_top_k(model: Any, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), layers, top_k]`` sorted expert ids the model's routers pick (-1 in dense
    layers), from transformers' own router logits."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), output_router_logits=True)
    want = torch.full((len(tokens), LAYERS, TOP_K), -1, dtype=torch.long)
    moe_layers = [i for i in range(LAYERS) if i not in TINY_MOE["mlp_only_layers"]]
    assert len(out.router_logits) == len(moe_layers)
    for layer, logits in zip(moe_layers, out.router_logits):
        want[:, layer] = torch.softmax(logits.float(), dim=-1).topk(TOP_K, dim=-1).indices.sort(dim=-1).values
    return want


def assert_routes_of_the_model(seg: Any, model: Any) -> None:
    """One record per token; the last token (never run) and the dense layer hold -1; every other
    record is the model's own top-k."""
    routes = seg.routed_experts
    assert routes is not None and routes.width == LAYERS * TOP_K and len(routes) == len(seg.tokens)
    got = routes.to_tensor(TOP_K).long()
    assert bool((got[-1] == -1).all()) and bool((got[:, 0] == -1).all())
    want = router_top_k(model, seg.tokens)
    assert torch.equal(got[:-1].sort(dim=-1).values, want[:-1])


def test_each_turn_records_the_experts_of_every_token_of_the_segment(moe_engine, router_factory):
    url, model = moe_engine
    router = router_factory([url], return_routed_experts=True)
    base = router.blocking.register("moe-1", sampling={"max_new_tokens": 12, "seed": 3})
    client = openai.OpenAI(base_url=base, api_key="k", max_retries=0)
    msgs = [{"role": "user", "content": "route me"}]
    first = client.chat.completions.create(model="m", messages=msgs)
    assert_routes_of_the_model(router.blocking.get("moe-1").segments[0], model)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "again"}]
    chunks = list(client.chat.completions.create(model="m", messages=msgs, stream=True))  # streamed: same record
    assert chunks
    record = router.blocking.pop("moe-1")
    [seg] = record.segments  # the second turn extends the first one's segment
    assert len(record.turns) == 2 and len(seg.turns) == 2
    assert_routes_of_the_model(seg, model)
    # the admin API's wire form keeps the record, compactly (base64 of int16)
    wire = json.loads(json.dumps(record.to_dict()))
    assert isinstance(wire["segments"][0]["routed_experts"]["ids"], str)
    assert TrajectoryRecord.from_dict(wire).segments[0].routed_experts == seg.routed_experts


def test_the_responses_and_messages_protocols_record_the_routing_too(moe_engine, router_factory):
    import anthropic

    url, model = moe_engine
    router = router_factory([url], return_routed_experts=True)
    base = router.blocking.register("moe-responses", sampling={"max_new_tokens": 8, "seed": 1})
    openai.OpenAI(base_url=base, api_key="k", max_retries=0).responses.create(model="p", input="route me")
    assert_routes_of_the_model(router.blocking.pop("moe-responses").segments[0], model)
    base = router.blocking.register("moe-messages", sampling={"max_new_tokens": 8, "seed": 2})
    anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key="k", max_retries=0).messages.create(
        model="p", max_tokens=8, messages=[{"role": "user", "content": "route me"}])
    assert_routes_of_the_model(router.blocking.pop("moe-messages").segments[0], model)


def test_a_turn_resumed_after_an_engine_abort_keeps_one_record_per_token(moe_engine, router_factory):
    url, model = moe_engine
    router = router_factory([url], return_routed_experts=True, turn_end_ids=[511])
    for attempt in range(5):  # a loaded machine may finish the turn before the pause lands: try again
        name = f"moe-pause-{attempt}"
        base = router.blocking.register(name, sampling={"max_new_tokens": 200, "seed": 4, "ignore_eos": True})
        client = openai.OpenAI(base_url=base, api_key="k", max_retries=0)
        worker = threading.Thread(target=client.chat.completions.create,
                                  kwargs={"model": "m", "messages": [{"role": "user", "content": "long"}]})
        before = engine_generated(url)
        worker.start()
        deadline = time.monotonic() + 60
        while engine_generated(url) == before:
            assert worker.is_alive() and time.monotonic() < deadline, "the request never started decoding"
            time.sleep(0.01)
        httpx.post(f"{url}/pause_generation", json={"mode": "abort"}).raise_for_status()
        httpx.post(f"{url}/continue_generation", json={}).raise_for_status()
        worker.join(300)
        record = router.blocking.pop(name)
        if record.turns[0].continuations:
            break
    assert record.turns[0].continuations >= 1, "every turn ended before the pause reached the engine"
    [seg] = record.segments
    assert seg.num_generated == 200
    assert_routes_of_the_model(seg, model)


def engine_generated(url: str) -> int:
    return httpx.get(url + "/get_server_info", trust_env=False).json()["internal_states"][0]["generated_tokens"]


def test_asking_a_dense_engine_for_routed_experts_is_refused_with_the_engines_reason(engine_url, router_factory):
    router = router_factory([engine_url], return_routed_experts=True)
    base = router.blocking.register("dense-1", sampling={"max_new_tokens": 4})
    with pytest.raises(openai.BadRequestError, match="no mixture-of-experts layers"):
        openai.OpenAI(base_url=base, api_key="k", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}])
    assert not router.blocking.pop("dense-1").segments  # nothing recorded for the refused turn
