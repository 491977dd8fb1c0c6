"""LoRA vs full fine-tuning on the same job: weight-sync bytes and seconds, trainer peak memory and step time.

The job is ``configs/recipes/grpo.toml`` (GRPO on the quickstart task); the LoRA variant adds
``train.lora = {rank, alpha}`` (and its own learning rate), nothing else. Two measurements, each
variant in a fresh subprocess so that one does not inherit the other's memory:

* ``run``: ``loongsage run`` of the job for ``--steps`` steps on a local Ray cluster; from its
  ``metrics.jsonl`` the mean over the steps after the first of ``perf/weight_sync_perf/weight_update_bytes``
  (what the transport moved into the engine), the sync's seconds, ``timing/train`` and
  ``timing/step``;
* ``trainer``: the torch backend's worker for the job's model alone (and for a larger random
  Qwen3, ``--hidden`` / ``--layers``, where the weights dominate memory): the peak resident set
  size it added (``ru_maxrss`` after building it and training ``--train-steps`` mini-batches,
  minus before), the median seconds of one mini-batch step, and the median seconds of a weight
  sync into an embedded engine in the same process (``inprocess``: a copy of every weight, or the
  adapter merged into the engine's weights).

* ``engine_decode``: the embedded engine serving the LoRA policy of the larger random model,
  ``--decode-prompts`` prompts x ``--decode-tokens`` new tokens per batch, with the adapter merged
  into its weights (``lora_mode = "merged"``, the default) and applied per request
  (``"unmerged"``: every request names it, and a batch where half do): the median generated
  tokens per second of each, and unmerged / merged.

Prints one JSON object with both variants and the LoRA / full ratios (absolute times on a shared
machine are noise; the ratios are the result). Run::

    python benchmarks/lora.py [--steps 3] [--rank 8] [--hidden 384] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "configs" / "recipes" / "grpo.toml"
TOKENIZER = REPO / "tests" / "data" / "tokenizer"
SYNC_KEYS = {"weight_update_bytes": "perf/weight_sync_perf/weight_update_bytes",
             "weight_sync_s": "perf/weight_sync_seconds"}


def lora_overrides(rank: int, lr: float) -> list[str]:
    return [f"train.lora={{rank={rank}, alpha={2 * rank}}}", f"train.lr={lr}"]


def run_job(variant: str, steps: int, rank: int, lora_lr: float) -> dict[str, float]:
    """``loongsage run`` of the job for ``steps`` steps; means of the sync and timing metrics."""
    overrides = [f"train.total_steps={steps}", "run.checkpoint_every=0", "run.save_hf_at_end=false",
                 "run.rollout_records=0"]
    if variant == "lora":
        overrides += lora_overrides(rank, lora_lr)
    with tempfile.TemporaryDirectory(prefix=f"bench-lora-{variant}-") as tmp:
        out = Path(tmp) / "run"
        proc = subprocess.run([sys.executable, "-m", "loongsage_core", "run", str(JOB), *overrides,
                               "--output-dir", str(out)], capture_output=True, text=True, cwd=tmp)
        if proc.returncode != 0:
            raise RuntimeError(f"{variant} run failed:\n{proc.stderr[-3000:]}")
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    later = metrics[1:] or metrics  # the first step also pays start-up costs
    result = {name: statistics.mean(m[key] for m in later) for name, key in SYNC_KEYS.items()}
    result["train_s"] = statistics.mean(m["timing/train"] for m in later)
    result["step_s"] = statistics.mean(m["timing/step"] for m in later)
    result["reward_mean"] = statistics.mean(m["rollout/reward_mean"] for m in metrics)
    return result


def trainer_child(variant: str, model: str, rank: int, lora_lr: float, train_steps: int, hidden: int,
                  layers: int) -> dict[str, float]:
    """In this (fresh) process: build the worker, train, report peak RSS growth and step time."""
    import torch
    from loongsage_plugin_torch.trainer import create_train_worker

    from loongsage_core.algorithms import compute_norm
    from loongsage_core.config import load_job
    from loongsage_core.plugins import PluginHost
    from loongsage_hookspecs import Batch, TrainWorkerContext

    overrides = lora_overrides(rank, lora_lr) if variant == "lora" else []
    job = load_job(JOB, overrides)
    if model == "large":  # a random Qwen3 whose weights dominate memory
        job.model.path = None
        job.model.tokenizer = str(TOKENIZER)
        job.model.config = large_model_config(hidden, layers)
    rows, width = job.train.mini_batch_size, 48
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 400, (rows, width), generator=g)
    mask = torch.zeros_like(ids)
    mask[:, 24:] = 1
    batch = Batch(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask,
                           "advantages": torch.randn(rows, 1, generator=g) * mask,
                           "old_logprobs": torch.zeros(rows, width), "rollout_logprobs": torch.zeros(rows, width)})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    worker = create_train_worker(TrainWorkerContext(job=job, components=PluginHost.from_job(job)))
    times = []
    for _ in range(train_steps):
        start = time.perf_counter()
        worker.train_mini_batch(batch, compute_norm(batch))
        times.append(time.perf_counter() - start)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    weights = list(worker.named_weights())
    from loongsage_plugin_torch.engine import create_engine
    from loongsage_plugin_torch.transport import inprocess_sender

    from loongsage_hookspecs import EngineContext, WeightTransportContext

    engine, syncs = create_engine(EngineContext(job=job, components=None)), []
    sender = inprocess_sender(WeightTransportContext(role="sender"))
    for version in range(1, 5):
        start = time.perf_counter()
        sender.send(worker.named_weights(), version, [engine])
        syncs.append(time.perf_counter() - start)
    return {"peak_rss_added_mb": peak_kib / 1024, "train_step_s": statistics.median(times[1:] or times),
            "sync_s": statistics.median(syncs[1:]),
            "trainable_params": float(sum(p.numel() for p in worker.model.parameters() if p.requires_grad)),
            "sync_bytes": float(sum(t.numel() * t.element_size() for _, t in weights))}


def large_model_config(hidden: int, layers: int) -> dict:
    """A random Qwen3 whose weights dominate memory and compute."""
    return {"model_type": "qwen3", "vocab_size": 512, "hidden_size": hidden, "intermediate_size": hidden * 3,
            "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": hidden // 8,
            "max_position_embeddings": 1024, "tie_word_embeddings": True}


def decode_child(rank: int, lora_lr: float, hidden: int, layers: int, prompts: int, tokens: int,
                 repeats: int = 3) -> dict[str, float]:
    """In this (fresh) process: generated tokens per second of the embedded engine with the LoRA
    adapter merged, unmerged for every request, and unmerged for half of them."""
    import httpx
    import torch
    from loongsage_plugin_torch.engine import create_engine
    from loongsage_plugin_torch.trainer import create_train_worker
    from loongsage_plugin_torch.transport import inprocess_sender

    from loongsage_core.config import load_job
    from loongsage_core.plugins import PluginHost
    from loongsage_hookspecs import LORA_ADAPTER_NAME, EngineContext, TrainWorkerContext, WeightTransportContext

    job = load_job(JOB, lora_overrides(rank, lora_lr))
    job.model.path, job.model.tokenizer = None, str(TOKENIZER)
    job.model.config = large_model_config(hidden, layers)
    worker = create_train_worker(TrainWorkerContext(job=job, components=PluginHost.from_job(job)))
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(1, 400, (prompts, 24), generator=g).tolist()
    sampling = {"temperature": 1.0, "max_new_tokens": tokens, "ignore_eos": True, "sampling_seed": 1}
    out: dict[str, float] = {}
    for label, mode, named in (("merged", "merged", prompts), ("unmerged", "unmerged", prompts),
                               ("unmerged_half_named", "unmerged", prompts // 2)):
        job.rollout.engine_args = {"lora_mode": mode, "prefix_cache_tokens": 0}
        engine = create_engine(EngineContext(job=job, components=None))
        url = engine.start()
        try:
            inprocess_sender(WeightTransportContext(role="sender")).send(worker.named_weights(), 1, [engine])
            body = {"input_ids": batch, "sampling_params": sampling,
                    "lora_path": [LORA_ADAPTER_NAME] * named + [None] * (prompts - named)}
            times = []
            for _ in range(repeats + 1):  # the first batch warms up
                start = time.perf_counter()
                response = httpx.post(url + "/generate", json=body, timeout=600, trust_env=False)
                response.raise_for_status()
                times.append(time.perf_counter() - start)
        finally:
            engine.shutdown()
        out[f"{label}_tokens_per_s"] = prompts * tokens / statistics.median(times[1:])
    out["unmerged_over_merged"] = out["unmerged_tokens_per_s"] / out["merged_tokens_per_s"]
    out["unmerged_half_named_over_merged"] = out["unmerged_half_named_tokens_per_s"] / out["merged_tokens_per_s"]
    return out


def trainer(variant: str, model: str, args: argparse.Namespace) -> dict[str, float]:
    return child_json([sys.executable, __file__, "--child", variant, model, "--rank", str(args.rank),
                       "--lora-lr", str(args.lora_lr), "--train-steps", str(args.train_steps),
                       "--hidden", str(args.hidden), "--layers", str(args.layers)], f"trainer {variant}/{model}")


def child_json(command: list[str], what: str) -> dict[str, float]:
    """Run a measurement in a fresh process; its last line of output is its JSON result."""
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ratios(full: dict[str, float], lora: dict[str, float]) -> dict[str, float]:
    return {k: lora[k] / full[k] for k in full if isinstance(full.get(k), float) and full[k]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps of each loongsage run")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lora-lr", type=float, default=2e-3)
    parser.add_argument("--train-steps", type=int, default=3, help="mini-batches per trainer measurement")
    parser.add_argument("--hidden", type=int, default=384, help="hidden size of the larger random model")
    parser.add_argument("--layers", type=int, default=4, help="layers of the larger random model")
    parser.add_argument("--decode-prompts", type=int, default=16, help="prompts of each engine decode batch")
    parser.add_argument("--decode-tokens", type=int, default=32, help="new tokens of each prompt")
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "MODEL"), help=argparse.SUPPRESS)
    parser.add_argument("--decode-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.decode_child:
        print(json.dumps(decode_child(args.rank, args.lora_lr, args.hidden, args.layers, args.decode_prompts,
                                      args.decode_tokens)))
        return
    if args.child:
        print(json.dumps(trainer_child(*args.child, args.rank, args.lora_lr, args.train_steps, args.hidden,
                                       args.layers)))
        return
    out: dict[str, dict] = {"job": {"file": str(JOB.relative_to(REPO)), "lora": lora_overrides(args.rank, args.lora_lr),
                                    "steps": args.steps}}
    for section, measure in (("run", lambda v: run_job(v, args.steps, args.rank, args.lora_lr)),
                             ("trainer_job_model", lambda v: trainer(v, "job", args)),
                             ("trainer_large_model", lambda v: trainer(v, "large", args))):
        full, lora = measure("full"), measure("lora")
        out[section] = {"full": full, "lora": lora, "lora_over_full": ratios(full, lora)}
    out["engine_decode"] = child_json([sys.executable, __file__, "--decode-child", "--rank", str(args.rank),
                                       "--lora-lr", str(args.lora_lr), "--hidden", str(args.hidden),
                                       "--layers", str(args.layers), "--decode-prompts", str(args.decode_prompts),
                                       "--decode-tokens", str(args.decode_tokens)], "engine decode")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
