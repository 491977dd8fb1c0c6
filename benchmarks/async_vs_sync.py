"""Async vs sync training throughput on a workload with heavy-tailed response lengths.

Same model, same prompts, same number of trained samples for every mode, measured in one run:
the synchronous loop and each asynchronous scheduler. Response lengths are heavy-tailed by
construction: four data sources whose ``max_new_tokens`` are 8 / 32 / 96 / 256 with weights
0.55 / 0.25 / 0.15 / 0.05, sampled from a randomly initialised model that rarely emits its
end-of-turn token, so most samples run to their source's limit. The trainer and the engine run
in separate actors with one CPU each (``placement.colocate = false``).

Prints JSON: wall time and trained samples/s per mode, the ratio to sync, and the idle fractions
(trainer waiting for data, from ``perf/wait_ratio``; engines idle while the trainer works is
``1 - rollout share`` for sync).

    python benchmarks/async_vs_sync.py [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

JOB = """
[plugins]
enable = ["torch", "rl", "rewards", "loggers", "agents", "schedulers"]
[model]
tokenizer = "{tokenizer}"
[model.config]
model_type = "qwen3"
vocab_size = 512
hidden_size = 128
intermediate_size = 256
num_hidden_layers = 4
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 32
max_position_embeddings = 1024
tie_word_embeddings = true
[train]
lr = 1e-5
total_steps = {steps}
mini_batch_size = 32
micro_batch_size = 16
[rollout]
prompts_per_step = 8
samples_per_prompt = 4
max_new_tokens = 256
max_context_length = 1024
weight_transport = "shm"
partial = true
[placement]
colocate = false
[async]
enable = {async_enable}
scheduler = "{scheduler}"
stale_steps = 1
[run]
seed = 0
save_hf_at_end = false
[[loggers]]
name = "jsonl"
{sources}
"""

SOURCES = [("short", 8, 0.55), ("medium", 32, 0.25), ("long", 96, 0.15), ("tail", 256, 0.05)]


def job_text(steps: int, scheduler: str | None) -> str:
    sources = "\n".join(
        f'[[data]]\nname = "{name}"\ngenerator = "arithmetic"\nweight = {w}\n'
        f'generator_args = {{ num_samples = 400, seed = {i} }}\nsampling = {{ max_new_tokens = {n} }}\n'
        for i, (name, n, w) in enumerate(SOURCES))
    return JOB.format(tokenizer=REPO / "tests" / "data" / "tokenizer", steps=steps,
                      async_enable="true" if scheduler else "false", scheduler=scheduler or "windowed_fifo",
                      sources=sources)


def run_mode(steps: int, scheduler: str | None, workdir: Path) -> dict[str, float]:
    from loongsage_core.config import load_job
    from loongsage_core.controller.run import run_job
    from loongsage_core.resolve import resolve_job

    path = workdir / f"{scheduler or 'sync'}.toml"
    path.write_text(job_text(steps, scheduler))
    start = time.perf_counter()
    history = run_job(resolve_job(load_job(path)), output_dir=str(workdir / (scheduler or "sync")))
    wall = time.perf_counter() - start
    samples = sum(m.get("rollout/num_rows", 0.0) for m in history)
    steady = history[1:] or history  # the first step includes start-up in every mode
    step_time = sum(m["timing/step"] for m in steady) / len(steady)
    wait = sum(m.get("perf/wait_ratio", m.get("timing/rollout", 0.0) / max(m["timing/step"], 1e-9))
               for m in steady) / len(steady)
    return {"wall_s": wall, "trained_samples": samples, "samples_per_s": samples / wall,
            "steady_step_s": step_time, "steady_samples_per_s": samples / len(history) / step_time,
            "trainer_wait_ratio": wait,
            "staleness_max": max(m.get("rollout/staleness_max", 0.0) for m in history)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--schedulers", default="windowed_fifo,window_gated,no_window")
    args = parser.parse_args()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 2**20, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        results["sync"] = run_mode(args.steps, None, work)
        for name in args.schedulers.split(","):
            results[name] = run_mode(args.steps, name, work)
    base = results["sync"]["steady_samples_per_s"]
    for r in results.values():
        r["throughput_vs_sync"] = r["steady_samples_per_s"] / base
    print(json.dumps({"benchmark": "async_vs_sync", "steps": args.steps, "modes": results}, indent=2))
    ray.shutdown()


if __name__ == "__main__":
    main()
