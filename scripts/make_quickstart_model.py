"""Build the warm-started tiny checkpoint of the quickstart (configs/quickstart/model/).

Why a warm start: reinforcement learning only sharpens what the policy already samples. A randomly
initialised model never writes a correct answer, so its reward stays at zero. This script gives a
tiny Qwen3 model the *format* of the quickstart task and a partial grasp of its *content*, leaving
plenty of room for GRPO to raise the reward.

The task (the ``arithmetic`` data source of loongsage-plugin-rewards, graded by ``exact_match``):
single-digit addition and subtraction, e.g. the user turn ``What is 7 - 9?`` and the assistant
answer ``-2``. Prompts are rendered with the chat template of tests/data/tokenizer without a
system prompt; the model answers with the bare number and ``<|im_end|>``.

The warm start is supervised training on every question of the task in which only a fraction
(``--p-correct``) of the target answers are right and the rest are drawn uniformly from the
task's answer range (fresh draws each epoch). The model learns the arithmetic table and the answer
format, but samples at temperature 1 reproduce the noisy mixture: about a quarter of the answers
are correct (and only about half of the greedy ones). GRPO raises the reward by moving probability
onto the right answers, which the model ranks high but not reliably first.

Measured with the defaults (one CPU thread): warm start 1-1.5 minutes; sampled accuracy 0.23
(greedy 0.49); the plain GRPO check of ``--verify-rl`` (8 prompts x 8 samples per step, lr 2e-4,
temperature 1, max 8 new tokens, 40 steps, ~13 s) ends at sampled accuracy 0.78 (greedy 0.96).

Usage::

    python scripts/make_quickstart_model.py                 # (re)writes configs/quickstart/model
    python scripts/make_quickstart_model.py --verify-rl     # ... and checks that a plain GRPO loop
                                                            #     raises the reward (a few minutes)
    python scripts/make_quickstart_model.py --out /tmp/m --verify-rl --rl-steps 40

Everything is seeded and runs on one CPU thread, so the same arguments rewrite the same weights.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from loongsage_plugin_rewards.rewards import exact_match
from loongsage_plugin_rewards.sources.arithmetic import arithmetic_rows
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

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


def sft_example(tok: PreTrainedTokenizerBase, question: str, answer: str) -> tuple[list[int], list[int]]:
    """(input ids, labels) with the loss on the answer and its ``<|im_end|>`` only."""
    p = prompt_ids(tok, question)
    a = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return p + a, [-100] * len(p) + a


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


def warm_start(model: PreTrainedModel, tok: PreTrainedTokenizerBase, questions: list[dict[str, Any]], *,
               p_correct: float, epochs: int, lr: float, batch_size: int, seed: int) -> None:
    """Supervised training on the task with a ``1 - p_correct`` share of random target answers."""
    rng = random.Random(seed)
    wrong_pool = answer_range(questions)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    steps = epochs * math.ceil(len(questions) / batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / steps))
    model.train()
    for epoch in range(epochs):
        order = questions[:]
        rng.shuffle(order)
        total = 0.0
        for start in range(0, len(order), batch_size):
            batch = []
            for q in order[start:start + batch_size]:
                answer = q["label"] if rng.random() < p_correct else str(rng.choice(wrong_pool))
                batch.append(sft_example(tok, q["prompt"], answer))
            width = max(len(x) for x, _ in batch)
            ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x, _ in batch])
            labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in batch])
            attention = (torch.arange(width)[None, :] < torch.tensor([len(x) for x, _ in batch])[:, None]).long()
            loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            total += loss.item()
        if (epoch + 1) % max(1, epochs // 10) == 0:
            print(f"  sft epoch {epoch + 1}/{epochs} loss {total / math.ceil(len(order) / batch_size):.3f}",
                  flush=True)


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
    model = build_model(tok, args.seed, args.model_config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"task: {len(questions)} questions, answers in [{answer_range(questions)[0]}, "
          f"{answer_range(questions)[-1]}]; model: {n_params} parameters", flush=True)
    warm_start(model, tok, questions, p_correct=1.0, epochs=args.clean_epochs, lr=args.lr,
               batch_size=args.batch_size, seed=args.seed)
    print("clean phase:", json.dumps(evaluate(model, tok, questions, samples=1, max_new_tokens=args.max_new_tokens,
                                              seed=args.seed + 1)), flush=True)
    warm_start(model, tok, questions, p_correct=args.p_correct, epochs=args.noisy_epochs, lr=args.noisy_lr,
               batch_size=args.batch_size, seed=args.seed + 3)
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
