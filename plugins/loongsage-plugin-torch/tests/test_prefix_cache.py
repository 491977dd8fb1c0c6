"""The embedded engine's prefix cache: later turns of a conversation prefill only their new tokens,
and what they generate (tokens and log-probs) is what an engine without the cache generates."""

from __future__ import annotations

from pathlib import Path

import torch
from loongsage_plugin_torch.engine import create_engine
from loongsage_plugin_torch.modeling import TINY_QWEN3

from loongsage_core.config import structure_job
from loongsage_core.engine_client import EngineClient
from loongsage_hookspecs import EngineContext

TOKENIZER = str(Path(__file__).resolve().parents[3] / "tests" / "data" / "tokenizer")


def start(prefix_cache_tokens: int):
    job = structure_job({"model": {"config": dict(TINY_QWEN3), "tokenizer": TOKENIZER, "seed": 11},
                         "rollout": {"max_context_length": 512, "engine_args": {
                             "num_threads": 1, "max_prefill_tokens": 64, "prefix_cache_tokens": prefix_cache_tokens}}})
    engine = create_engine(EngineContext(job=job, components=None))
    return engine, EngineClient(engine.start())


def test_cached_turns_generate_what_uncached_turns_generate():
    g = torch.Generator().manual_seed(4)
    system = torch.randint(3, 512, (150,), generator=g).tolist()  # > max_prefill_tokens: chunked
    users = [torch.randint(3, 512, (7,), generator=g).tolist() for _ in range(4)]
    runs = {}
    for cache in (4096, 0):
        engine, client = start(cache)
        try:
            context, turns = list(system), []
            for turn, user in enumerate(users):
                context += user
                res = client.generate_sync([context], {"temperature": 1.0, "sampling_seed": turn,
                                                       "max_new_tokens": 8, "ignore_eos": True})[0]
                turns.append(res)
                context += res.output_ids
            runs[cache] = turns
        finally:
            client.close()
            engine.shutdown()
    cached, plain = runs[4096], runs[0]
    assert [r.cached_tokens for r in plain] == [0, 0, 0, 0]
    assert cached[0].cached_tokens == 0
    for i in range(1, 4):  # every later turn reuses the previous turn's whole sequence but its last token
        previous = cached[i - 1].prompt_tokens + len(cached[i - 1].output_ids)
        assert cached[i].cached_tokens >= previous - 1
        assert cached[i].prompt_tokens - cached[i].cached_tokens <= len(users[i]) + 1
    for a, b in zip(cached, plain):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
