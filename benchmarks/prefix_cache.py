"""Prefix caching in the embedded engine: seconds per turn of a long agent conversation.

An agent CLI (Codex, Claude Code, OpenCode) resends its whole conversation every turn: a system
prompt and tool schemas of ten to twenty thousand tokens, then the turns so far. This benchmark
plays such a conversation against the embedded engine over real HTTP (``EngineClient``): a shared
prefix of ``--prefix`` random tokens, then ``--turns`` turns that each append ``--user`` new
tokens (the tool result or user message) and generate ``--new`` tokens; each turn's prompt is the
previous turn's prompt plus its answer plus the new tokens. The same conversation runs on one
engine with the prefix cache (``prefix_cache_tokens`` large enough for it) and one without
(``prefix_cache_tokens = 0``), one after the other, with the same model, seed and threads.

Prints one JSON object: seconds per turn for both, the engine's ``cached_tokens`` per turn, and
``speedup_after_first`` (median seconds per turn after the first, uncached / cached; the target is
at least 5x). Generated tokens and log-probs of the two runs are compared as a check.

    python benchmarks/prefix_cache.py [--prefix 16384 --turns 10 --threads 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Any


def build_job(args: argparse.Namespace, cache_tokens: int) -> Any:
    from loongsage_core.config import structure_job

    context = args.prefix + args.turns * (args.user + args.new) + 64
    config = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": args.hidden,
              "intermediate_size": 2 * args.hidden, "num_hidden_layers": args.layers,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": args.hidden // 4,
              "max_position_embeddings": max(32768, context), "tie_word_embeddings": True}
    return structure_job({
        "model": {"config": config, "seed": args.seed},
        "rollout": {"max_context_length": context,
                    "engine_args": {"num_threads": args.threads, "max_prefill_tokens": args.chunk,
                                    "prefix_cache_tokens": cache_tokens}},
    })


def play(args: argparse.Namespace, cache_tokens: int) -> dict[str, Any]:
    """One conversation on a fresh engine; seconds, cached tokens, tokens and log-probs per turn."""
    import torch
    from loongsage_plugin_torch.engine import create_engine

    from loongsage_core.engine_client import EngineClient
    from loongsage_hookspecs import EngineContext

    gen = torch.Generator().manual_seed(args.seed)
    context = torch.randint(3, 512, (args.prefix,), generator=gen).tolist()
    engine = create_engine(EngineContext(job=build_job(args, cache_tokens), components=None))
    client = EngineClient(engine.start(), timeout=3600)
    seconds, cached, outputs, logprobs = [], [], [], []
    try:
        for turn in range(args.turns):
            context = context + torch.randint(3, 512, (args.user,), generator=gen).tolist()
            t0 = time.perf_counter()
            res = client.generate_sync([context], {"temperature": 1.0, "sampling_seed": turn,
                                                   "max_new_tokens": args.new, "ignore_eos": True})[0]
            seconds.append(time.perf_counter() - t0)
            cached.append(res.cached_tokens)
            outputs.append(res.output_ids)
            logprobs.append(res.logprobs)
            context = context + res.output_ids
    finally:
        client.close()
        engine.shutdown()
    return {"seconds": seconds, "cached_tokens": cached, "outputs": outputs, "logprobs": logprobs,
            "final_context_tokens": len(context)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", type=int, default=16384, help="shared prefix tokens (system prompt + tools)")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--user", type=int, default=64, help="new prompt tokens per turn")
    parser.add_argument("--new", type=int, default=32, help="generated tokens per turn")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=1024, help="max_prefill_tokens (chunked prefill)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    cached = play(args, cache_tokens=2 * (args.prefix + args.turns * (args.user + args.new)))
    plain = play(args, cache_tokens=0)
    later = slice(1, None)
    speedup = statistics.median(plain["seconds"][later]) / statistics.median(cached["seconds"][later])
    lp_diff = max(abs(a - b) for x, y in zip(cached["logprobs"], plain["logprobs"]) for a, b in zip(x, y))
    print(json.dumps({
        "benchmark": "prefix_cache",
        "setup": {k: getattr(args, k) for k in ("prefix", "turns", "user", "new", "hidden", "layers", "chunk",
                                                "threads")} | {"machine": platform.machine(),
                                                               "final_context_tokens": cached["final_context_tokens"]},
        "cached_seconds_per_turn": [round(s, 3) for s in cached["seconds"]],
        "uncached_seconds_per_turn": [round(s, 3) for s in plain["seconds"]],
        "cached_tokens_per_turn": cached["cached_tokens"],
        "speedup_first_turn": round(plain["seconds"][0] / cached["seconds"][0], 2),
        "speedup_after_first": round(speedup, 2),
        "target_speedup_after_first": 5.0,
        "same_tokens": cached["outputs"] == plain["outputs"],
        "max_logprob_abs_diff": lp_diff,
    }, indent=2))


if __name__ == "__main__":
    main()
