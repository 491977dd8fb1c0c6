"""Speculative decoding (prompt lookup) in the embedded engine: decode speed-up per workload.

Two workloads, each played on an engine without speculation and on one with
``engine_args.speculative`` (same model, seed, threads and prompts; both engines up at once and
timed alternately in this run), over real HTTP (``EngineClient``):

* ``copy_heavy``: a file-edit turn. The prompt holds a source file and asks for the whole file
  back with one function renamed, so most of the answer echoes the prompt; a group of
  ``--samples`` answers is sampled at ``--temperature``, as an RL step samples a group.
* ``plain``: the plain RL workload: ``--plain-prompts`` short questions, ``--samples`` answers
  each, at ``--temperature``: little to copy, so speculation must not cost time.

Prints one JSON object: per workload the seconds of every timed run with and without
speculation (``--repeats`` runs of the same seeded batch, alternating; the fastest of each counts,
so a busy machine disturbs less),
``speculative_decode_speedup`` (generated tokens per second, speculative / plain: sampled answers
differ in length between the two engines; greedy ones are the same tokens), ``acceptance_rate``
(accepted / drafted tokens), ``tokens_per_forward`` and the tokens generated. The model is a real
one (``--model``, default ``models/smollm2-135m-instruct``, written by
``python scripts/make_smollm2.py``); its chat template renders the prompts.

    python benchmarks/speculative.py [--model models/smollm2-135m-instruct --threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from typing import Any

SOURCE = '''import json
from pathlib import Path


def load_records(path):
    """Read one JSON object per line of ``path``."""
    records = []
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if line:
                records.append(json.loads(line))
    return records


def total_price(records):
    """The sum of every record's price times its quantity."""
    total = 0.0
    for record in records:
        total += record["price"] * record.get("quantity", 1)
    return total


def cheapest(records, count=3):
    """The ``count`` records with the lowest price."""
    return sorted(records, key=lambda record: record["price"])[:count]


def write_report(records, out):
    """Write the total and the cheapest records to ``out`` as JSON."""
    report = {"total": total_price(records), "cheapest": cheapest(records)}
    Path(out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    write_report(load_records("orders.jsonl"), "report.json")
'''

EDIT = ("Here is a Python file:\n\n```python\n" + SOURCE + "```\n\nRename the function `total_price` to "
        "`order_total` everywhere. Reply with the complete updated file in one code block and nothing else.")

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Why is the sky blue?",
             "Give me a tip for sleeping better.", "What is 12 times 12?", "Write a haiku about rain.",
             "How do plants make food?", "What does a compiler do?"]


def build_job(args: argparse.Namespace, speculative: bool) -> Any:
    from loongsage_core.config import structure_job

    engine_args: dict[str, Any] = {"num_threads": args.threads, "max_batch_size": 64}
    if speculative:
        engine_args["speculative"] = {"method": "prompt_lookup", "num_draft": args.num_draft, "ngram": args.ngram}
    return structure_job({"model": {"path": args.model, "dtype": "float32"},
                          "rollout": {"max_context_length": 2048, "engine_args": engine_args},
                          "run": {"seed": args.seed}})


def start_engine(args: argparse.Namespace, speculative: bool) -> tuple[Any, Any]:
    from loongsage_plugin_torch.engine import create_engine

    from loongsage_core.engine_client import EngineClient
    from loongsage_hookspecs import EngineContext

    engine = create_engine(EngineContext(job=build_job(args, speculative), components=None))
    return engine, EngineClient(engine.start(), timeout=3600)


def workload(args: argparse.Namespace, prompts: list[list[int]], max_new: int) -> dict[str, Any]:
    """Every prompt's ``--samples`` answers on an engine without and one with speculation, timed
    alternately ``--repeats`` times (the same seeded batch; the fastest run of each counts)."""
    batch = [p for p in prompts for _ in range(args.samples)]
    params = [{"temperature": args.temperature, "max_new_tokens": max_new, "sampling_seed": args.seed + i}
              for i in range(len(batch))]
    engines = {name: start_engine(args, name == "speculative") for name in ("plain", "speculative")}
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    results: dict[str, Any] = {}
    try:
        for _, client in engines.values():  # warm-up: first-call costs out of the timing
            client.generate_sync(prompts[:1], {"max_new_tokens": 2})
        for _ in range(args.repeats):
            for name, (_, client) in engines.items():
                t0 = time.perf_counter()
                results[name] = client.generate_sync(batch, params)
                seconds[name].append(time.perf_counter() - t0)
    finally:
        for engine, client in engines.values():
            client.close()
            engine.shutdown()
    meta = [r.meta_info for r in results["speculative"]]
    drafted = sum(m["spec_draft_tokens"] for m in meta)
    tokens = {name: sum(len(r.output_ids) for r in res) for name, res in results.items()}
    plain_s, spec_s = min(seconds["plain"]), min(seconds["speculative"])
    out = {"prompts": len(prompts), "samples": args.samples, "prompt_tokens": sum(map(len, prompts)),
           "max_new_tokens": max_new, "plain_seconds": [round(x, 2) for x in seconds["plain"]],
           "speculative_seconds": [round(x, 2) for x in seconds["speculative"]],
           # generated tokens per second, speculative / plain: sampled answers differ between the two
           # engines (other random draws), so their lengths do too; greedy, this is the seconds' ratio
           "speculative_decode_speedup": round(tokens["speculative"] / spec_s / (tokens["plain"] / plain_s), 2),
           "acceptance_rate": round(sum(m["spec_accepted_tokens"] for m in meta) / max(1, drafted), 3),
           "tokens_per_forward": round(sum(m["spec_emitted_tokens"] for m in meta)
                                       / max(1, sum(m["spec_verify_ct"] for m in meta)), 2),
           "draft_tokens": drafted, "plain_tokens": tokens["plain"], "speculative_tokens": tokens["speculative"],
           "plain_tokens_per_s": round(tokens["plain"] / plain_s, 1),
           "speculative_tokens_per_s": round(tokens["speculative"] / spec_s, 1)}
    if args.temperature == 0:
        out["same_tokens"] = [r.output_ids for r in results["plain"]] == [r.output_ids for r in results["speculative"]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--samples", type=int, default=4, help="answers per prompt (a group)")
    parser.add_argument("--copy-new", type=int, default=384, help="max_new_tokens of the file-edit turn")
    parser.add_argument("--plain-prompts", type=int, default=8)
    parser.add_argument("--plain-new", type=int, default=96, help="max_new_tokens of the plain workload")
    parser.add_argument("--num-draft", type=int, default=4)
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine (the fastest counts)")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)

    def chat(text: str) -> list[int]:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))

    copy_heavy = workload(args, [chat(EDIT)], args.copy_new)
    plain = workload(args, [chat(q) for q in QUESTIONS[: args.plain_prompts]], args.plain_new)
    print(json.dumps({
        "benchmark": "speculative",
        "setup": {k: getattr(args, k) for k in ("model", "temperature", "samples", "num_draft", "ngram", "threads",
                                                "seed", "repeats")}
                 | {"machine": platform.machine(), "load_average": [round(x, 1) for x in os.getloadavg()]},
        "copy_heavy": copy_heavy, "plain": plain,
        "target": {"copy_heavy_speedup": 1.5, "plain_speedup": 1.0},
    }, indent=2))


if __name__ == "__main__":
    main()
