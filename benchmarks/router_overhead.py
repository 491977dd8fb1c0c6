#!/usr/bin/env python3
"""What the AgentFlow router adds on top of the rollout engine, on loopback. Prints JSON.

Side by side, with the same prompts and sampling settings against the same embedded engine
(tiny random Qwen3 of loongsage-plugin-torch, CPU). Engine, router and clients run in three
processes, as in a deployment (the router is its own Ray actor there):

* ``direct``: ``POST /generate`` with pre-tokenized ``input_ids`` (what the engine costs alone);
* ``router``: ``POST /{trajectory}/0/v1/chat/completions`` with chat messages (template
  rendering, TITO bookkeeping, engine call, OpenAI response).

Latency: sequential calls, median and p90 per call; the router's added latency is the median of
paired differences (each router call next to the direct call of the same turn), which keeps
drifting machine load out of it.
Per protocol (``protocols``: Chat Completions, Responses, Anthropic Messages), paired the same
way: the added latency of a non-streaming call, and the time to the first streamed text event
against the time to the first streamed token of ``/generate`` with ``stream: true``.
Throughput: ``--concurrency`` clients in parallel, requests per second for each path.
``--turns`` > 1 makes every router trajectory a growing conversation, so later calls pay the
delta rendering of a longer history (the direct path gets the same token contexts).

    python benchmarks/router_overhead.py --requests 200 --concurrency 16 --max-tokens 4 --turns 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


TOKENIZER = str(REPO / "tests/data/tokenizer")


def serve_engine(urls: Any, context: int) -> None:
    """Child process: the embedded engine; its URL goes to ``urls``; serves until terminated."""
    from loongsage_plugin_torch.engine import create_engine
    from loongsage_plugin_torch.modeling import TINY_QWEN3

    from loongsage_core.config import structure_job
    from loongsage_hookspecs import EngineContext

    job = structure_job({"model": {"config": dict(TINY_QWEN3), "tokenizer": TOKENIZER},
                         "rollout": {"max_context_length": context, "engine_args": {"num_threads": 1}}})
    urls.put(create_engine(EngineContext(job=job, components=None)).start())
    threading.Event().wait()


def serve_router(urls: Any, engine_url: str) -> None:
    """Child process: the AgentFlow router in front of ``engine_url``; serves until terminated."""
    from loongsage_core.agentflow import AgentFlowRouter

    urls.put(AgentFlowRouter(TOKENIZER, [engine_url]).start())
    threading.Event().wait()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def conversation(client: Any, router: Any, renderer: Any, engine_url: str, name: str, turns: int,
                       max_tokens: int, direct: bool, lat: list[float]) -> None:
    """One trajectory of ``turns`` calls, through the router or straight to the engine.

    Router trajectories are registered beforehand and collected afterwards (see :func:`batch`),
    so only chat completions are timed.
    """
    sampling = sampling_for(max_tokens)
    url = router.url_for(name)
    messages = [{"role": "user", "content": f"Question {name}: what is 12 * 34?"}]
    tokens: list[int] = []
    for turn in range(turns):
        if direct:
            if turn == 0:
                tokens = renderer.prompt_tokens(messages)
            payload = {"input_ids": tokens, "return_logprob": True,
                       "sampling_params": {**sampling, "stop_token_ids": list(renderer.turn_end_ids)}}
            t0 = time.perf_counter()
            resp = await client.post(f"{engine_url}/generate", json=payload)
            lat.append(time.perf_counter() - t0)
            out = resp.json()["output_ids"]
            tokens = tokens + out + renderer.encode("<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n"
                                                           "<|im_start|>assistant\n")
        else:
            t0 = time.perf_counter()
            resp = await client.post(f"{url}/chat/completions", json={"model": "m", "messages": messages})
            lat.append(time.perf_counter() - t0)
            body = resp.json()
            messages = messages + [body["choices"][0]["message"], {"role": "user", "content": "more"}]


PROTOCOLS: dict[str, tuple[str, Any]] = {
    "chat": ("/chat/completions", lambda text, n: {"model": "m", "messages": [{"role": "user", "content": text}]}),
    "responses": ("/responses", lambda text, n: {"model": "m", "input": text}),
    "anthropic": ("/messages", lambda text, n: {"model": "m", "max_tokens": n,
                                                "messages": [{"role": "user", "content": text}]}),
}


def is_text_event(protocol: str, event: dict[str, Any]) -> bool:
    """Whether a streamed event carries generated text (per protocol), or a token (engine)."""
    if protocol == "direct":
        return bool(event.get("output_ids"))
    if protocol == "chat":
        return bool(event.get("choices") and event["choices"][0]["delta"].get("content"))
    if protocol == "responses":
        return event.get("type") == "response.output_text.delta"
    return event.get("type") == "content_block_delta" and event["delta"].get("type") == "text_delta"


async def first_text_s(client: Any, url: str, body: dict[str, Any], protocol: str) -> float:
    """Seconds until the first text event of a streamed call (the rest is read to the end)."""
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", url, json={**body, "stream": True}) as resp:
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {") and is_text_event(protocol, json.loads(line[6:])):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"{protocol}: the stream had no text event")
    return first


async def protocol_latency(client: Any, router: Any, renderer: Any, engine_url: str, calls: int,
                           max_tokens: int) -> dict[str, Any]:
    """Per protocol: added latency of a call and added time to the first streamed token, paired."""
    out: dict[str, Any] = {}
    # enough tokens that a stream has a first token well before its last
    sampling = {**sampling_for(max(max_tokens, 16)), "stop_token_ids": [511]}
    for protocol, (path, make) in PROTOCOLS.items():
        added: list[float] = []
        ttft: list[float] = []
        ttft_direct: list[float] = []
        for i in range(calls + 2):  # the first two warm up
            text = f"Question {i}: what is 12 * 34?"
            prompt = renderer.prompt_tokens([{"role": "user", "content": text}])
            direct = {"input_ids": prompt, "return_logprob": True, "sampling_params": sampling}
            names = [f"{protocol}-{i}-{k}" for k in range(2)]
            for name in names:
                await router.aregister(name, sampling=sampling)
            t0 = time.perf_counter()
            (await client.post(f"{engine_url}/generate", json=direct)).raise_for_status()
            t_direct = time.perf_counter() - t0
            t0 = time.perf_counter()
            (await client.post(router.url_for(names[0]) + path, json=make(text, sampling["max_new_tokens"]))
             ).raise_for_status()
            t_router = time.perf_counter() - t0
            f_direct = await first_text_s(client, f"{engine_url}/generate", direct, "direct")
            f_router = await first_text_s(client, router.url_for(names[1]) + path,
                                          make(text, sampling["max_new_tokens"]), protocol)
            for name in names:
                await router.apop(name)
            if i >= 2:
                added.append(t_router - t_direct)
                ttft.append(f_router)
                ttft_direct.append(f_direct)
        out[protocol] = {
            "added_median_ms": round(statistics.median(added) * 1000, 3),
            "first_token_median_ms": round(statistics.median(ttft) * 1000, 3),
            "engine_first_token_median_ms": round(statistics.median(ttft_direct) * 1000, 3),
            "first_token_added_median_ms": round(statistics.median(
                [r - d for r, d in zip(ttft, ttft_direct)]) * 1000, 3),
        }
    return out


def sampling_for(max_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}


async def batch(router: Any, names: list[str], max_tokens: int, run: Any) -> Any:
    """Register ``names`` with the router, await ``run``, collect the trajectories."""
    await asyncio.gather(*(router.aregister(n, sampling=sampling_for(max_tokens)) for n in names))
    result = await run
    await asyncio.gather(*(router.apop(n) for n in names))
    return result


async def measure(router: Any, renderer: Any, engine_url: str, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        convs = max(1, args.requests // args.turns)
        t = args.turns, args.max_tokens

        async def sequential(prefix: str, direct: bool, lat: list[float], n: int) -> None:
            for i in range(n):
                await conversation(client, router, renderer, engine_url, f"{prefix}{i}", *t, direct, lat)

        async def parallel(prefix: str, direct: bool, lat: list[float]) -> float:
            sem = asyncio.Semaphore(args.concurrency)

            async def one(i: int) -> None:
                async with sem:
                    await conversation(client, router, renderer, engine_url, f"{prefix}{i}", *t, direct, lat)

            t0 = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(convs)))
            return time.perf_counter() - t0

        # warm-up: connections, caches, first-call costs
        await batch(router, [f"w{i}" for i in range(3)], args.max_tokens, sequential("w", False, [], 3))
        await sequential("wd", True, [], 3)
        result: dict[str, Any] = {}
        seq: dict[str, list[float]] = {"direct": [], "router": []}
        names = [f"r{i}" for i in range(convs)]
        await asyncio.gather(*(router.aregister(n, sampling=sampling_for(args.max_tokens)) for n in names))
        for i in range(convs):  # paired: each router conversation right after its direct twin
            await conversation(client, router, renderer, engine_url, f"d{i}", *t, True, seq["direct"])
            await conversation(client, router, renderer, engine_url, f"r{i}", *t, False, seq["router"])
        await asyncio.gather(*(router.apop(n) for n in names))
        for path, lat in seq.items():
            result[f"{path}_median_ms"] = round(statistics.median(lat) * 1000, 3)
            result[f"{path}_p90_ms"] = round(percentile(lat, 0.9) * 1000, 3)
        added = [r - d for r, d in zip(seq["router"], seq["direct"])]
        result["router_added_median_ms"] = round(statistics.median(added) * 1000, 3)
        lat_d: list[float] = []
        elapsed = await parallel("pd", True, lat_d)
        result["direct_requests_per_s"] = round(len(lat_d) / elapsed, 2)
        lat_r: list[float] = []
        elapsed = await batch(router, [f"pr{i}" for i in range(convs)], args.max_tokens, parallel("pr", False, lat_r))
        result["router_requests_per_s"] = round(len(lat_r) / elapsed, 2)
        result["protocols"] = await protocol_latency(client, router, renderer, engine_url, args.protocol_calls,
                                                     args.max_tokens)
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=120, help="calls per measurement and path")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--turns", type=int, default=1, help="calls per trajectory (conversation length)")
    parser.add_argument("--protocol-calls", type=int, default=30, help="paired calls per protocol")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from loongsage_core.agentflow import ChatRenderer, RouterClient

    ctx = multiprocessing.get_context("spawn")
    urls = ctx.Queue()
    engine = ctx.Process(target=serve_engine, args=(urls, 4096), daemon=True)
    engine.start()
    engine_url = urls.get(timeout=300)
    router = ctx.Process(target=serve_router, args=(urls, engine_url), daemon=True)
    router.start()
    router_url = urls.get(timeout=300)
    try:
        renderer = ChatRenderer(AutoTokenizer.from_pretrained(TOKENIZER))
        result = asyncio.run(measure(RouterClient(router_url), renderer, engine_url, args))
    finally:
        for proc in (router, engine):
            proc.terminate()
            proc.join(10)
    print(json.dumps({"benchmark": "router_overhead", "requests": args.requests, "concurrency": args.concurrency,
                      "max_tokens": args.max_tokens, "turns": args.turns, **result}, indent=2))


if __name__ == "__main__":
    main()
