"""Build the agent fixture model (tests/data/agent_model/): a tiny Qwen3 with a 32K context that
drives real agent CLIs (Codex, Claude Code, OpenCode) through one tool round trip.

Agent CLIs send prompts of 10-20K tokens (system prompt, tool schemas) and expect the protocol's
format back. A random model answers with noise and never calls a tool, so the CLI tests could not
see a tool round trip. This script warm-starts a tiny Qwen3 (2 layers, hidden 64, vocabulary 512
of tests/data/tokenizer, ``max_position_embeddings`` 32768) on two rules of the chat template:

* a turn that follows a user message answers with one hermes-style tool call,
  ``<tool_call>{"name": "bash", "arguments": {"command": "echo hello > hello.txt", ...}}</tool_call>``
  (the router's ``tool_call_parser`` turns it into the protocol's tool call; OpenCode's tool is
  called ``bash`` and runs it, the other CLIs answer that the tool is unknown);
* a turn that follows a tool result (``...</tool_response><|im_end|>``) answers ``Done.``.

Both cues are the last few tokens before the assistant header, so the model need not read the
whole prompt; but softmax attention over tens of thousands of tokens dilutes what a short-context
model learned, so training mixes short prompts with long ones (up to ``--max-len`` tokens) of
real text (this repository's Markdown) and random tokens. Each answer is learned to near
certainty, so sampling at temperature 1 reproduces it.

Usage::

    python scripts/make_agent_model.py              # (re)writes tests/data/agent_model
    python scripts/make_agent_model.py --check      # ... and only checks the written model

Deterministic for the same arguments (seeded; one torch thread by default). A few minutes on a
2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "tests" / "data" / "tokenizer"
OUT = ROOT / "tests" / "data" / "agent_model"

MODEL_CONFIG: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 32768, "tie_word_embeddings": True, "rope_theta": 1000000.0,
}
TOOL_CALL = ('<tool_call>\n{"name": "bash", "arguments": {"command": "echo hello > hello.txt", '
             '"description": "Write hello.txt"}}\n</tool_call>')
FINAL = "Done."
TOOLS_HEADER = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
                '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n')


def corpus_ids(tok: PreTrainedTokenizerBase) -> list[int]:
    """Token ids of this repository's Markdown: real text to build prompts from."""
    paths = sorted([*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *ROOT.glob("plugins/*/README.md")])
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in paths)
    return tok(text, add_special_tokens=False)["input_ids"]


class Examples:
    """Prompts that end like a chat-template turn, with the answer the model must give."""

    def __init__(self, tok: PreTrainedTokenizerBase, seed: int) -> None:
        self.tok = tok
        self.rng = random.Random(seed)
        self.corpus = corpus_ids(tok)
        self.special = set(tok.all_special_ids)
        self.plain = [i for i in range(len(tok)) if i not in self.special]

        def ids(text: str) -> list[int]:
            return tok(text, add_special_tokens=False)["input_ids"]

        self.ids = ids
        self.call = ids(TOOL_CALL + "<|im_end|>")
        self.final = ids(FINAL + "<|im_end|>")

    def filler(self, n: int) -> list[int]:
        if n <= 0:
            return []
        if self.rng.random() < 0.7 and len(self.corpus) > n:
            start = self.rng.randrange(len(self.corpus) - n)
            return self.corpus[start: start + n]
        return [self.rng.choice(self.plain) for _ in range(n)]

    def example(self, length: int) -> tuple[list[int], list[int]]:
        """(input ids, labels): about ``length`` prompt tokens, loss on the answer only."""
        ids = self.ids
        if self.rng.random() < 0.8:  # tools offered: the template's hermes header (it holds <tool_call> too)
            split = self.rng.randint(0, max(0, length - 300))
            head = (ids("<|im_start|>system\n") + self.filler(split) + ids(TOOLS_HEADER)
                    + self.filler(max(0, length - 300 - split)) + ids(TOOLS_FOOTER))
        else:
            head = ids("<|im_start|>system\n") + self.filler(max(0, length - 120)) + ids("<|im_end|>\n")
        user = ids("<|im_start|>user\n") + self.filler(self.rng.randint(3, 60)) + ids("<|im_end|>\n")
        prompt = head + user
        if self.rng.random() < 0.5:  # a tool result follows the model's call: answer
            prompt += ids("<|im_start|>assistant\n") + self.call + ids("\n")
            prompt += ids("<|im_start|>user\n<tool_response>\n") + self.filler(self.rng.randint(1, 40))
            prompt += ids("\n</tool_response><|im_end|>\n")
            answer = self.final
        else:
            answer = self.call
        prompt += ids("<|im_start|>assistant\n")
        return prompt + answer, [-100] * len(prompt) + answer


def build_model(tok: PreTrainedTokenizerBase, seed: int) -> Any:
    config = AutoConfig.for_model("qwen3", bos_token_id=None, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id, **MODEL_CONFIG)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def train(model: Any, data: Examples, steps: int, max_len: int, lr: float, long_every: int = 5, min_long: int = 0,
          log_every: int = 50) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / steps))
    model.train()
    t0 = time.time()
    for step in range(steps):
        # mostly short prompts (batch of 8), every ``long_every``-th step one long prompt
        if step % long_every == long_every - 1:
            batch = [data.example(data.rng.randint(min_long or max_len // 4, max_len))]
        else:
            n = data.rng.randint(40, 600)
            batch = [data.example(n) for _ in range(8)]
        width = max(len(x) for x, _ in batch)
        input_ids = torch.tensor([x + [0] * (width - len(x)) for x, _ in batch])
        labels = torch.tensor([y + [-100] * (width - len(y)) for _, y in batch])
        loss = model(input_ids=input_ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % log_every == 0 or step == steps - 1:
            print(f"step {step} len {width} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)


@torch.no_grad()
def check(model: Any, data: Examples, lengths: list[int]) -> dict[str, Any]:
    """Greedy answers and the lowest per-token probability of the target, per prompt length."""
    model.eval()
    out: dict[str, Any] = {}
    for n in lengths:
        x, y = data.example(n)
        ids = torch.tensor([x])
        logits = model(input_ids=ids).logits[0, :-1].float()
        target = torch.tensor(y[1:])
        keep = target != -100
        probs = torch.softmax(logits[keep], -1).gather(-1, target[keep, None])[:, 0]
        greedy = logits[keep].argmax(-1)
        out[str(n)] = {"min_prob": round(float(probs.min()), 5),
                       "greedy_exact": bool((greedy == target[keep]).all())}
    return out


def save(model: Any, tok: PreTrainedTokenizerBase, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    model.config.use_cache = True
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "README.md").write_text(
        "# Agent fixture model (tiny Qwen3, 32K context)\n\n"
        "Written by `scripts/make_agent_model.py` (deterministic; rerun it to regenerate). "
        "2 layers, hidden 64, vocabulary 512 (tests/data/tokenizer), `max_position_embeddings` 32768.\n"
        "After a user message it answers with one hermes tool call\n\n"
        f"    {TOOL_CALL}\n\nand after a tool result (`</tool_response>`) with `{FINAL}`. The agent CLI tests "
        "use it to see a real tool round trip through Codex, Claude Code and OpenCode.\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--long-every", type=int, default=5, help="every n-th step trains on one long prompt")
    parser.add_argument("--min-long", type=int, default=0, help="shortest long prompt (default: max-len / 4)")
    parser.add_argument("--init", type=Path, help="continue from this model instead of a random one")
    parser.add_argument("--check", action="store_true", help="only evaluate the model in --out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.out if args.check else TOKENIZER)
    data = Examples(tok, args.seed + 1)
    if args.check:
        model = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    else:
        model = (AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32) if args.init
                 else build_model(tok, args.seed))
        train(model, data, args.steps, args.max_len, args.lr, args.long_every, args.min_long)
    result = check(model, Examples(tok, args.seed + 100), [60, 500, 4000, 16000, 28000])
    print(json.dumps(result))
    if not args.check:
        save(model, tok, args.out)


if __name__ == "__main__":
    main()
