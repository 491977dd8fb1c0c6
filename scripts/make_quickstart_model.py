"""Build the warm-started tiny checkpoint of the quickstart (configs/quickstart/model/).

Why a warm start: reinforcement learning only sharpens what the policy already samples. A randomly
initialised model never writes a correct answer, so its reward stays at zero. This script gives a
tiny Qwen3 model the *format* of the quickstart task and a partial grasp of its *content*, leaving
plenty of room for GRPO to raise the reward.

The task (the ``arithmetic`` data source of loongsage-plugin-rewards, graded by ``exact_match``):
single-digit addition and subtraction, e.g. the user turn ``What is 7 - 9?`` and the assistant
answer ``-2``. Prompts are rendered with the chat template of tests/data/tokenizer without a
system prompt; the model answers with the bare number and ``<|im_end|>``.

The warm start is supervised fine-tuning with ``loongsage sft`` (its Python entry,
:func:`loongsage_core.sft.run.run_sft`, on the torch backend): first on every question of the task
with its correct answer, then on the questions again with targets of which only a fraction
(``--p-correct``) are right and the rest are drawn uniformly from the task's answer range (fresh
draws for each pass). Each phase is an SFT job on a chat JSONL file written by this script.
The model learns the arithmetic table and the answer format, but samples at temperature 1
reproduce the noisy mixture: well under half of the answers are correct (and only about half of
the greedy ones). GRPO raises the reward by moving probability
onto the right answers, which the model ranks high but not reliably first.

Measured with the defaults (one CPU thread of a loaded 2-core machine): warm start about 4
minutes (560 + 125 SFT steps); sampled accuracy 0.38 (greedy 0.58); the plain GRPO check of
``--verify-rl`` (8 prompts x 8 samples per step, lr 2e-4, temperature 1, max 8 new tokens, 40
steps, ~40 s) ends at sampled accuracy 0.76 (greedy 0.92).

Usage::

    python scripts/make_quickstart_model.py                 # (re)writes configs/quickstart/model
    python scripts/make_quickstart_model.py --verify-rl     # ... and checks that a plain GRPO loop
                                                            #     raises the reward (a few minutes)
    python scripts/make_quickstart_model.py --out /tmp/m --verify-rl --rl-steps 40

Everything is seeded and runs on one CPU thread, so the same arguments rewrite the same weights.
The SFT runs (metrics.jsonl, final_hf/ of each phase) go to a temporary directory, or to
``--work-dir`` to keep them.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from loongsage_plugin_rewards.rewards import exact_match
from loongsage_plugin_rewards.sources.arithmetic import arithmetic_rows
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from loongsage_core.config import structure_job
from loongsage_core.resolve import resolve_sft_job
from loongsage_core.sft.run import run_sft
from loongsage_hookspecs import Trajectory

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "tests" / "data" / "tokenizer"
OUT = ROOT / "configs" / "quickstart" / "model"

TASK_ARGS: dict[str, Any] = {"digits": 1, "num_operands": 2, "ops": "+-"}
"""``generator_args`` of the quickstart's ``arithmetic`` data source (plus ``seed``/``num_samples``)."""

MODEL_CONFIG: dict[str, Any] = {
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 96,
    "intermediate_size": 192,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
}


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def task_questions() -> list[dict[str, Any]]:
    """Every distinct question of the task (the data source's rows, deduplicated, sorted)."""
    rows = arithmetic_rows(num_samples=4000, seed=0, **TASK_ARGS)
    unique = {row["prompt"]: row for row in rows}
    return [unique[k] for k in sorted(unique)]


def answer_range(questions: list[dict[str, Any]]) -> list[int]:
    answers = [q["metadata"]["answer"] for q in questions]
    return list(range(min(answers), max(answers) + 1))


def prompt_ids(tok: PreTrainedTokenizerBase, question: str) -> list[int]:
    """Token ids of the chat-formatted prompt, ending with the assistant header."""
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def chat_row(question: str, answer: str) -> dict[str, Any]:
    """One SFT row: the question as the user turn (no system prompt), the bare answer as the reply."""
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


# --------------------------------------------------------------------------------------------
# Model, sampling, evaluation
# --------------------------------------------------------------------------------------------


def build_model(tok: PreTrainedTokenizerBase, seed: int, overrides: dict[str, Any]) -> PreTrainedModel:
    conf = dict(MODEL_CONFIG, **overrides)
    model_type = conf.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, bos_token_id=None, eos_token_id=tok.eos_token_id,
                                     pad_token_id=tok.pad_token_id, **conf)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)


@torch.no_grad()
def sample(model: PreTrainedModel, tok: PreTrainedTokenizerBase, questions: list[str], *, temperature: float,
           max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Sample one answer per question: (left-padded sequences, response mask, response texts)."""
    ids = [prompt_ids(tok, q) for q in questions]
    width = max(len(x) for x in ids)
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(x)) + x for x in ids])
    attention = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    model.eval()
    out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=temperature,
                         top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    response = out[:, width:]
    mask = torch.ones_like(response)
    texts = []
    for i, row in enumerate(response.tolist()):
        end = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
        mask[i, end:] = 0
        texts.append(tok.decode(row[:end], skip_special_tokens=True))
    return torch.cat([input_ids, response], 1), torch.cat([torch.zeros_like(input_ids), mask], 1), texts


def score(texts: list[str], labels: list[str]) -> list[float]:
    """The ``exact_match`` reward of each response (the reward the quickstart job uses)."""
    return [exact_match(Trajectory(id=str(i), prompt_id=str(i), group_id=str(i), response_text=t, label=lab)).score
            for i, (t, lab) in enumerate(zip(texts, labels))]


def evaluate(model: PreTrainedModel, tok: PreTrainedTokenizerBase, questions: list[dict[str, Any]], *,
             samples: int, max_new_tokens: int, seed: int) -> dict[str, float]:
    """Mean sampled (temperature 1) and greedy-ish (temperature 0.05) accuracy over ``questions``."""
    torch.manual_seed(seed)
    prompts = [q["prompt"] for q in questions] * samples
    labels = [q["label"] for q in questions] * samples
    _, _, texts = sample(model, tok, prompts, temperature=1.0, max_new_tokens=max_new_tokens)
    sampled = sum(score(texts, labels)) / len(texts)
    well_formed = sum(t.strip().lstrip("-").isdigit() for t in texts) / len(texts)
    _, _, texts = sample(model, tok, [q["prompt"] for q in questions], temperature=0.05,
                         max_new_tokens=max_new_tokens)
    greedy = sum(score(texts, [q["label"] for q in questions])) / len(questions)
    return {"sampled_accuracy": sampled, "greedy_accuracy": greedy, "well_formed": well_formed}


# --------------------------------------------------------------------------------------------
# Warm start
# --------------------------------------------------------------------------------------------


def sft_job(rows: list[dict[str, Any]], work: Path, *, model: dict[str, Any], epochs: int, lr: float,
            batch_size: int, seed: int) -> dict[str, Any]:
    """The ``loongsage sft`` job of one warm-start phase (its rows written to ``work/data.jsonl``).

    AdamW without weight decay, gradient clipping at 1, 20 warmup steps then a linear decay to a
    tenth of ``lr``; one micro-batch per step; conversations packed into rows of 256 tokens.
    """
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "plugins": {"enable": ["torch", "loggers"]},
        "model": model,
        "train": {"lr": lr, "lr_schedule": "linear", "lr_warmup_steps": 20, "min_lr_ratio": 0.1,
                  "weight_decay": 0.0, "grad_clip": 1.0, "mini_batch_size": batch_size,
                  "micro_batch_size": batch_size},
        "sft": {"epochs": epochs, "packing": True, "max_seq_len": 256},
        "data": [{"name": "arithmetic", "path": str(data)}],
        "loggers": [{"name": "jsonl"}],
        "run": {"seed": seed, "output_dir": str(work / "run")},
    }


def run_phase(name: str, job: dict[str, Any]) -> Path:
    """Run one SFT phase; prints its loss every tenth of the run; returns its ``final_hf`` directory."""
    resolved = resolve_sft_job(structure_job(job, f"<quickstart {name}>"))
    out = Path(job["run"]["output_dir"])
    history = run_sft(resolved.job, resolved.host, str(out))
    every = max(1, len(history) // 10)
    for i in range(every - 1, len(history), every):
        window = history[i + 1 - every:i + 1]
        print(f"  {name} step {i + 1}/{len(history)} loss {sum(m['sft/loss'] for m in window) / len(window):.3f}",
              flush=True)
    return out / "final_hf"


def finetune(name: str, questions: list[dict[str, Any]], work: Path, *, model: dict[str, Any], p_correct: float,
             epochs: int, lr: float, batch_size: int, seed: int) -> Path:
    """One SFT phase on ``questions``; returns its ``final_hf`` directory.

    ``model`` is the job's ``[model]`` table (an inline config or a ``path``). With ``p_correct``
    below 1, each of the ``epochs`` passes draws fresh targets of which a ``1 - p_correct`` share are
    random answers of the task's range (written out as ``epochs`` copies of the questions, trained
    once); otherwise the right answers are trained ``epochs`` times.
    """
    if p_correct >= 1.0:
        rows = [chat_row(q["prompt"], q["label"]) for q in questions]
        passes = epochs
    else:
        rng = random.Random(seed)
        wrong_pool = answer_range(questions)
        rows = [chat_row(q["prompt"], q["label"] if rng.random() < p_correct else str(rng.choice(wrong_pool)))
                for _ in range(epochs) for q in questions]
        passes = 1
    return run_phase(name, sft_job(rows, work / name, model=model, epochs=passes, lr=lr, batch_size=batch_size,
                                   seed=seed))


def warm_start(tok: PreTrainedTokenizerBase, questions: list[dict[str, Any]], work: Path, *,
               model_config: dict[str, Any], seed: int, clean_epochs: int, noisy_epochs: int, p_correct: float,
               lr: float, noisy_lr: float, batch_size: int) -> tuple[Path, Path]:
    """The two SFT phases; returns the ``final_hf`` directories of the clean and the noisy phase.

    Clean: every question with its correct answer, ``clean_epochs`` passes, from a random
    initialisation drawn from ``seed``. Noisy: ``noisy_epochs`` fresh draws of every question in
    which a ``1 - p_correct`` share of targets are random answers, from the clean phase's model.
    """
    conf = dict(MODEL_CONFIG, **model_config)
    conf.update(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    clean = finetune("clean", questions, work, model={"config": conf, "tokenizer": str(TOKENIZER), "seed": seed},
                     p_correct=1.0, epochs=clean_epochs, lr=lr, batch_size=batch_size, seed=seed)
    noisy = finetune("noisy", questions, work, model={"path": str(clean), "tokenizer": str(TOKENIZER)},
                     p_correct=p_correct, epochs=noisy_epochs, lr=noisy_lr, batch_size=batch_size, seed=seed + 3)
    return clean, noisy


def load_trained(path: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


# --------------------------------------------------------------------------------------------
# The plain on-policy GRPO check
# --------------------------------------------------------------------------------------------


def token_logprobs(model: PreTrainedModel, seqs: torch.Tensor, attention: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """``logprobs[i, t] = log p(seqs[i, t] | seqs[i, :t])`` at ``temperature`` (position 0 holds 0)."""
    position_ids = (attention.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=seqs, attention_mask=attention, position_ids=position_ids).logits[:, :-1]
    logits = logits / temperature
    lp = torch.log_softmax(logits.float(), -1).gather(-1, seqs[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], 1)


def grpo_check(model: PreTrainedModel, tok: PreTrainedTokenizerBase, questions: list[dict[str, Any]], *,
               steps: int, prompts_per_step: int, samples_per_prompt: int, lr: float, temperature: float,
               max_new_tokens: int, seed: int) -> list[float]:
    """Plain on-policy GRPO: group-normalised advantages, token-mean REINFORCE loss, one step per batch.

    Returns the mean training reward of every step.
    """
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rows = arithmetic_rows(num_samples=steps * prompts_per_step, seed=seed, **TASK_ARGS)
    history = []
    for step in range(steps):
        t0 = time.perf_counter()
        batch = rows[step * prompts_per_step:(step + 1) * prompts_per_step]
        prompts = [r["prompt"] for r in batch for _ in range(samples_per_prompt)]
        labels = [r["label"] for r in batch for _ in range(samples_per_prompt)]
        seqs, resp_mask, texts = sample(model, tok, prompts, temperature=temperature, max_new_tokens=max_new_tokens)
        rewards = torch.tensor(score(texts, labels)).view(prompts_per_step, samples_per_prompt)
        adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
        adv = adv.reshape(-1, 1)
        attention = ((seqs != tok.pad_token_id) | (resp_mask == 1)).long()
        model.train()
        lp = token_logprobs(model, seqs, attention, temperature)
        mask = resp_mask.float()
        loss = -(adv * lp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history.append(rewards.mean().item())
        print(f"  grpo step {step + 1:3d}/{steps} reward {history[-1]:.3f} "
              f"({time.perf_counter() - t0:.2f}s)", flush=True)
    return history


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="where to write the checkpoint (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clean-epochs", type=int, default=80, help="epochs on correct answers only")
    parser.add_argument("--noisy-epochs", type=int, default=20, help="epochs on partly random answers")
    parser.add_argument("--p-correct", type=float, default=0.3, help="share of correct targets when noisy")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of the clean phase")
    parser.add_argument("--noisy-lr", type=float, default=3e-4, help="peak learning rate of the noisy phase")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--model-config", type=json.loads, default={}, help="JSON overrides of the model config")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="keep the SFT runs of the warm start here (default: a temporary directory)")
    parser.add_argument("--verify-rl", action="store_true", help="run the plain GRPO check after saving")
    parser.add_argument("--rl-steps", type=int, default=40)
    parser.add_argument("--rl-lr", type=float, default=2e-4)
    parser.add_argument("--rl-prompts", type=int, default=8)
    parser.add_argument("--rl-samples", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    questions = task_questions()
    n_params = sum(p.numel() for p in build_model(tok, args.seed, args.model_config).parameters())
    print(f"task: {len(questions)} questions, answers in [{answer_range(questions)[0]}, "
          f"{answer_range(questions)[-1]}]; model: {n_params} parameters", flush=True)
    with tempfile.TemporaryDirectory(prefix="quickstart-sft-") as tmp:
        work = args.work_dir or Path(tmp)
        clean, noisy = warm_start(tok, questions, work, model_config=args.model_config, seed=args.seed,
                                  clean_epochs=args.clean_epochs, noisy_epochs=args.noisy_epochs,
                                  p_correct=args.p_correct, lr=args.lr, noisy_lr=args.noisy_lr,
                                  batch_size=args.batch_size)
        print("clean phase:", json.dumps(evaluate(load_trained(clean), tok, questions, samples=1,
                                                  max_new_tokens=args.max_new_tokens, seed=args.seed + 1)),
              flush=True)
        model = load_trained(noisy)
    print(f"warm start done in {time.perf_counter() - t0:.0f}s", flush=True)
    before = evaluate(model, tok, questions, samples=4, max_new_tokens=args.max_new_tokens, seed=args.seed + 1)
    print("after warm start:", json.dumps(before), flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config.do_sample = True
    model.generation_config.temperature = 1.0
    model.generation_config.top_k = 0
    model.generation_config.top_p = 1.0
    model.save_pretrained(str(args.out), safe_serialization=True)
    tok.save_pretrained(str(args.out))
    print(f"wrote {args.out}", flush=True)

    if args.verify_rl:
        t1 = time.perf_counter()
        history = grpo_check(model, tok, questions, steps=args.rl_steps, prompts_per_step=args.rl_prompts,
                             samples_per_prompt=args.rl_samples, lr=args.rl_lr, temperature=args.temperature,
                             max_new_tokens=args.max_new_tokens, seed=args.seed + 2)
        after = evaluate(model, tok, questions, samples=4, max_new_tokens=args.max_new_tokens, seed=args.seed + 1)
        k = max(1, len(history) // 5)
        print(json.dumps({
            "before": before, "after": after, "steps": len(history),
            "train_reward_first": sum(history[:k]) / k, "train_reward_last": sum(history[-k:]) / k,
            "rl_seconds": round(time.perf_counter() - t1, 1),
        }), flush=True)
        if after["sampled_accuracy"] < before["sampled_accuracy"] + 0.2:
            print("the plain GRPO loop did not raise the sampled accuracy by 0.2", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
