"""TRL's ``GRPOTrainer`` vs LoongSage: seconds per GRPO step on the same workloads, in one run.

Both frameworks train the same randomly initialised model (written once to a local directory and
loaded by both: only speed is measured) on the same prompts, in the same order, with the same
learning rate, dtype (float32), group size, completion length and thread count: one optimizer
step per generation, no reference model (``beta = 0`` / no KL), so neither needs an old-log-prob
pass. Workloads:

* ``135m``: a config shaped like a 135M-parameter Llama (SmolLM2-135M: 30 layers, hidden 576,
  vocabulary 49152), 4 prompts x 8 samples, 24 new tokens;
* ``small``: a tiny Qwen3 (6 layers, hidden 384, vocabulary 512), 4 prompts x 8 samples, 16 new
  tokens.

The first step of each framework is a warm-up and is not counted. The frameworks run in
``--rounds`` alternating rounds (TRL first in odd rounds, LoongSage first in even ones), so a
drift of the host's speed over the minutes of a run weighs on both alike; the seconds per step
are the mean over every round's measured steps, and ``speedup_per_round`` shows the spread.
TRL runs in a fresh child process each round (its model and optimizer state do not stay in
memory while LoongSage runs). LoongSage runs as users run it (a local Ray cluster, the embedded
engine colocated with the trainer); its per-phase MFU (``perf/mfu_*``, against the probed matmul rate) is
reported too. Prints JSON with, per workload, ``trl_s_per_step``, ``loongsage_s_per_step``,
``speedup_vs_trl`` and the MFU.

``trl`` is a benchmark-only dependency (``pip install -r benchmarks/requirements-bench.txt``),
never one of the framework's.

    python benchmarks/vs_trl.py [--workloads small,135m] [--steps 4] [--threads 2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "tests" / "data" / "tokenizer"

WORKLOADS: dict[str, dict[str, Any]] = {
    "135m": {"new_tokens": 24, "config": {
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "max_position_embeddings": 2048, "tie_word_embeddings": True, "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5}},
    "small": {"new_tokens": 16, "config": {
        "model_type": "qwen3", "vocab_size": 512, "hidden_size": 384, "intermediate_size": 1024,
        "num_hidden_layers": 6, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64,
        "max_position_embeddings": 1024, "tie_word_embeddings": True, "rope_theta": 10000.0}},
}
PROMPTS_PER_STEP = 4
SAMPLES = 8
LR = 1e-5


def write_model(name: str, workdir: Path) -> Path:
    """The workload's model (seed 0) and the test tokenizer in one Hugging Face directory."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = workdir / f"model_{name}"
    cfg = dict(WORKLOADS[name]["config"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    model.save_pretrained(str(out))
    for f in TOKENIZER.iterdir():
        shutil.copy(f, out / f.name)
    return out


def write_prompts(workdir: Path, count: int) -> Path:
    """``count`` arithmetic prompts with their answers, one JSON object a line."""
    path = workdir / "prompts.jsonl"
    with path.open("w", encoding="utf-8") as fh:
        for i in range(count):
            a, b = (7 * i) % 10, (3 * i + 1) % 10
            fh.write(json.dumps({"prompt": f"What is {a} + {b}?", "label": str(a + b)}) + "\n")
    return path


def run_trl(model_dir: Path, prompts: Path, new_tokens: int, steps: int, threads: int, workdir: Path) -> dict[str, Any]:
    """Seconds per step of TRL's GRPOTrainer (steps after the first)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(threads)
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]}
                              for r in rows])

    def exact_match(completions: list[Any], label: list[str], **_: Any) -> list[float]:
        texts = [c[0]["content"] if isinstance(c, list) else str(c) for c in completions]
        return [1.0 if re.search(rf"\b{re.escape(lab)}\b", t) else 0.0 for t, lab in zip(texts, label)]

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.start = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.times.append(time.perf_counter() - self.start)

    timer = StepTimes()
    config = GRPOConfig(output_dir=str(workdir / "trl"), per_device_train_batch_size=PROMPTS_PER_STEP * SAMPLES,
                        num_generations=SAMPLES, steps_per_generation=1, num_iterations=1, beta=0.0,
                        max_completion_length=new_tokens, learning_rate=LR, temperature=1.0, max_steps=steps,
                        use_cpu=True, bf16=False, fp16=False, gradient_accumulation_steps=1, logging_steps=1,
                        report_to="none", save_strategy="no", shuffle_dataset=False, dataloader_num_workers=0,
                        lr_scheduler_type="constant", seed=0, disable_dropout=True)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=config, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(str(model_dir)), callbacks=[timer])
    trainer.train()
    measured = timer.times[1:] or timer.times
    return {"trl_s_per_step": sum(measured) / len(measured), "trl_step_times": timer.times}


JOB = """
[plugins]
enable = ["torch", "rl", "rewards", "agents", "loggers"]
[model]
path = "{model}"
dtype = "float32"
[train]
lr = {lr}
total_steps = {steps}
mini_batch_size = {rows}
micro_batch_size = {micro}
{packing}
[rollout]
prompts_per_step = {prompts}
samples_per_prompt = {samples}
max_new_tokens = {new_tokens}
max_context_length = 512
temperature = 1.0
weight_transport = "inprocess"
engine_args = {{ num_threads = {threads} }}
[placement]
colocate = true
offload = false
trainer_cpus = {threads}
[algorithm]
advantage = "grpo"
policy_loss = "ppo_clip"
loss_agg = "token_mean"
[run]
seed = 0
checkpoint_every = 0
save_hf_at_end = false
rollout_records = 0
[[data]]
name = "arith"
path = "{data}"
shuffle = false
agent = "single_turn"
reward = ["exact_match"]
[[loggers]]
name = "jsonl"
"""


def quiet(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` with its progress prints on stderr: stdout is the JSON."""
    with contextlib.redirect_stdout(sys.stderr):
        return fn(*args)


def run_trl_in_child(*args: Any) -> dict[str, Any]:
    """:func:`run_trl` in a fresh process that exits afterwards, so TRL's model, optimizer and
    threads (gigabytes on ``135m``) are gone before LoongSage runs, and LoongSage's before TRL's."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(quiet, run_trl, *args).result()


def run_loongsage(model_dir: Path, prompts: Path, new_tokens: int, steps: int, threads: int, micro: int,
                  pack_tokens: int | None, workdir: Path, name: str) -> dict[str, Any]:
    """Seconds per step of LoongSage (steps after the first) and its per-phase MFU."""
    from loongsage_core.config import load_job
    from loongsage_core.controller.run import run_job
    from loongsage_core.resolve import resolve_job

    job = workdir / f"loongsage_{name}.toml"
    job.write_text(JOB.format(model=model_dir, lr=LR, steps=steps, rows=PROMPTS_PER_STEP * SAMPLES, micro=micro,
                              packing=f"max_tokens_per_micro_batch = {pack_tokens}" if pack_tokens else "",
                              prompts=PROMPTS_PER_STEP, samples=SAMPLES, new_tokens=new_tokens, threads=threads,
                              data=prompts))
    history = run_job(resolve_job(load_job(job)), output_dir=str(workdir / f"run_{name}"))
    measured = history[1:] or history
    out: dict[str, Any] = {"loongsage_s_per_step": sum(m["timing/step"] for m in measured) / len(measured),
                           "loongsage_step_times": [m["timing/step"] for m in history]}
    for key in ("perf/mfu_train", "perf/mfu_logprob", "perf/mfu_rollout", "perf/peak_tflops",
                "perf/old_logprob_pass_skipped", "timing/rollout", "timing/policy_train", "timing/old_logprobs"):
        values = [m[key] for m in measured if key in m]
        if values:
            out[key] = sum(values) / len(values)
    return out


def combine_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One workload's result over its rounds: seconds per step as the mean of every round's
    measured steps (each round's first step is its warm-up), LoongSage's metrics averaged over
    the rounds, and each round's own speedup."""
    def measured(key: str) -> list[float]:
        return [t for r in rounds for t in (r[key][1:] or r[key])]

    trl, ours = measured("trl_step_times"), measured("loongsage_step_times")
    out: dict[str, Any] = {"trl_s_per_step": sum(trl) / len(trl), "loongsage_s_per_step": sum(ours) / len(ours),
                           "trl_step_times": [r["trl_step_times"] for r in rounds],
                           "loongsage_step_times": [r["loongsage_step_times"] for r in rounds],
                           "speedup_per_round": [r["trl_s_per_step"] / r["loongsage_s_per_step"] for r in rounds]}
    for key in sorted({k for r in rounds for k in r if k.startswith(("perf/", "timing/"))}):
        values = [r[key] for r in rounds if key in r]
        out[key] = sum(values) / len(values)
    out["speedup_vs_trl"] = out["trl_s_per_step"] / out["loongsage_s_per_step"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="135m,small")
    parser.add_argument("--steps", type=int, default=4, help="steps per framework (the first is a warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of both frameworks")
    parser.add_argument("--micro-batch-size", type=int, default=32, help="LoongSage's rows per micro-batch")
    parser.add_argument("--pack-tokens", type=int, default=None,
                        help="LoongSage's [train] max_tokens_per_micro_batch (padding-free micro-batches)")
    args = parser.parse_args()
    import ray

    from loongsage_core.controller.placement import start_local_cluster

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prompts = write_prompts(work, PROMPTS_PER_STEP * (args.steps + 1))
        start_local_cluster(num_cpus=max(args.threads, 2), object_store_mb=256)
        try:
            for name in [w.strip() for w in args.workloads.split(",") if w.strip()]:
                if name not in WORKLOADS:
                    raise SystemExit(f"vs_trl.py: unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
                model_dir = write_model(name, work)
                new_tokens = WORKLOADS[name]["new_tokens"]
                rounds: list[dict[str, Any]] = []
                for index in range(args.rounds):
                    res: dict[str, Any] = {}
                    runs = [functools.partial(run_trl_in_child, model_dir, prompts, new_tokens, args.steps,
                                              args.threads, work),
                            functools.partial(quiet, run_loongsage, model_dir, prompts, new_tokens, args.steps,
                                              args.threads, args.micro_batch_size, args.pack_tokens, work,
                                              f"{name}_{index}")]
                    for run in runs if index % 2 == 0 else runs[::-1]:
                        res.update(run())
                    rounds.append(res)
                results[name] = combine_rounds(rounds)
        finally:
            ray.shutdown()
    print(json.dumps({"benchmark": "vs_trl", "steps": args.steps, "threads": args.threads, "rounds": args.rounds,
                      "prompts_per_step": PROMPTS_PER_STEP, "samples_per_prompt": SAMPLES, "lr": LR,
                      "dtype": "float32", "workloads": results}, indent=2))


if __name__ == "__main__":
    main()
