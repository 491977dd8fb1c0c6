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

Both cues are the last tokens before the assistant header, so the model need not read the whole
prompt, and it cannot: every layer attends through a **sliding window** of ``WINDOW`` tokens
(``layer_types`` all ``sliding_attention``, as Mistral-style models do; the embedded engine and the
trainer both run such models). An answer token therefore depends on the last
``RECEPTIVE_FIELD`` tokens alone, and RoPE only sees relative positions, so a prompt of 20K tokens
looks to the model exactly like its last few hundred. A full-attention model trained on synthetic
prompts learned the rules, then lost them on the CLIs' real prompts, whose tens of thousands of
tool-schema tokens outweighed the cue (it answered ``</tool_call>``, copied from the hermes
instructions).

Training mixes prompts shorter than the window with prompts well past the receptive field (the
state every long prompt is in), of real text (this repository's Markdown) and random tokens, with
one to three user messages in a row of up to a few hundred tokens (the CLIs' environment context
and reminders). Each answer is learned to near certainty, so sampling at temperature 1
reproduces it.

With ``--cli-rounds N`` the script also learns the CLIs' own prompts, taken the way the tests meet
them: each round serves the model trained so far with the real embedded engine and AgentFlow
router, runs every installed CLI (``.tools/npm``, from ``scripts/install_agent_clis.sh``) once on
the tests' task, and keeps the prompt of every model turn it asked for. Round 1 sees the first
turn of each CLI; once the model writes its tool call, the next round also sees the turn that
follows the CLI's tool result. Each real prompt is varied as the tests vary it (working-directory
names, dates) and trained on every ``--real-every``-th step, cut to the tokens the answer can see
(:func:`visible_tail`, exact for a sliding-window model). The prompts are taken at build time from
the pinned CLIs, never stored.

Usage::

    python scripts/make_agent_model.py --cli-rounds 2   # (re)writes tests/data/agent_model
    python scripts/make_agent_model.py --check          # ... and only checks the written model

Deterministic for the same arguments (seeded; one torch thread by default). A few minutes on a
2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "tests" / "data" / "tokenizer"
OUT = ROOT / "tests" / "data" / "agent_model"

WINDOW = 256
MODEL_CONFIG: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 32768, "tie_word_embeddings": True, "rope_theta": 1000000.0,
    # every layer sliding: a query sees the WINDOW tokens up to itself
    "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 0,
}
RECEPTIVE_FIELD = MODEL_CONFIG["num_hidden_layers"] * (WINDOW - 1) + 1
"""How many tokens up to itself one position's output depends on, through all the layers."""
TOOL_CALL = ('<tool_call>\n{"name": "bash", "arguments": {"command": "echo hello > hello.txt", '
             '"description": "Write hello.txt"}}\n</tool_call>')
FINAL = "Done."
TOOLS_HEADER = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
                '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n')


# what the CLI tests (tests/test_agent_clis.py) run: the task, and each CLI's flags
CLI_TASK = "Create the file hello.txt with the word hello in it."
CLI_ARGS: dict[str, dict[str, Any]] = {"codex": {}, "claude_code": {"args": ["--tools", "Bash,Read,Write,Edit"]},
                                       "opencode": {}}
TEMP_NAME = re.compile(r"(loongsage-[a-z_]+-work-)[a-z0-9_]{8}")  # the agents plugin's working directories
NAME_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")


@attrs.define(frozen=True)
class CliPrompt:
    """The prompt of one model turn a CLI asked for, as text, and whether a tool result precedes it."""

    cli: str
    text: str
    after_tool_result: bool


def capture_cli_prompts(model_dir: Path) -> list[CliPrompt]:
    """Run every agent CLI once against the real engine and router serving ``model_dir``; return
    the prompt of each model turn it asked for (what the router rendered, exactly as recorded)."""
    import asyncio

    from loongsage_plugin_agents.tool_parser import ToolCallParser
    from loongsage_plugin_torch.engine.engine import EmbeddedEngine

    from loongsage_core.agentflow import AgentFlowRouter, run_agent_trajectory
    from loongsage_core.config import structure_job
    from loongsage_core.plugins import PluginHost
    from loongsage_hookspecs import BuildContext, ComponentRef, EngineContext, Trajectory

    host = PluginHost.create(["agents"])
    job = structure_job({"model": {"path": str(model_dir)},
                         "rollout": {"max_context_length": MODEL_CONFIG["max_position_embeddings"],
                                     "engine_args": {"max_prefill_tokens": 4096, "prefix_cache_tokens": 131072}}})
    engine = EmbeddedEngine(EngineContext(job=job, components=None))
    url = engine.start()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    router = AgentFlowRouter(tok, [url], [ToolCallParser(format="hermes")])
    router.start()
    prompts: list[CliPrompt] = []
    try:
        for name in CLI_ARGS:
            agent = host.bind(ComponentRef("agent", name, {**CLI_ARGS[name], "timeout_s": 600}),
                              BuildContext(components=host))
            traj = Trajectory(id=f"capture-{name}", prompt_id="p0", group_id="g0", prompt=CLI_TASK)
            traj = asyncio.run(run_agent_trajectory(
                router, agent, None, trajectory=traj,
                sampling={"max_new_tokens": 96, "temperature": 0.0}, timeout_s=660))
            answers = []
            for seg in traj.segments:
                for start, end in seg.turns:
                    text = tok.decode(seg.tokens[:start])
                    # the turns before this one's assistant header: a tool result after the last answer?
                    earlier = text[: text.rfind("<|im_start|>assistant")]
                    after_tool = earlier.rfind("<tool_response>") > earlier.rfind("<|im_start|>assistant")
                    prompts.append(CliPrompt(name, text, after_tool))
                    answers.append(f"{start} tokens -> {tok.decode(seg.tokens[start:end])!r}")
            print(f"{name}: {traj.status.value}; " + "; ".join(answers), flush=True)
    finally:
        router.shutdown()
        engine.shutdown()
    return prompts


def corpus_ids(tok: PreTrainedTokenizerBase) -> list[int]:
    """Token ids of this repository's Markdown: real text to build prompts from."""
    paths = sorted([*ROOT.glob("*.md"), *ROOT.glob("docs/**/*.md"), *ROOT.glob("plugins/*/README.md")])
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

    def user_turns(self) -> list[int]:
        """One to three user messages in a row, of 3 to 400 tokens each (the task, and the
        environment context and reminders the CLIs send beside it)."""
        turns: list[int] = []
        for _ in range(self.rng.choice((1, 1, 2, 3))):
            turns += self.ids("<|im_start|>user\n") + self.filler(self.rng.randint(3, 400)) + self.ids("<|im_end|>\n")
        return turns

    def example(self, length: int) -> tuple[list[int], list[int]]:
        """(input ids, labels): about ``length`` prompt tokens, loss on the answer only."""
        ids = self.ids
        if self.rng.random() < 0.8:  # tools offered: the template's hermes header (it holds <tool_call> too)
            split = self.rng.randint(0, max(0, length - 300))
            head = (ids("<|im_start|>system\n") + self.filler(split) + ids(TOOLS_HEADER)
                    + self.filler(max(0, length - 300 - split)) + ids(TOOLS_FOOTER))
        else:
            head = ids("<|im_start|>system\n") + self.filler(max(0, length - 120)) + ids("<|im_end|>\n")
        prompt = head + self.user_turns()
        if self.rng.random() < 0.5:  # a tool result follows the model's call: answer
            prompt += ids("<|im_start|>assistant\n") + self.call + ids("\n")
            prompt += ids("<|im_start|>user\n<tool_response>\n") + self.filler(self.rng.randint(1, 200))
            prompt += ids("\n</tool_response><|im_end|>\n")
            answer = self.final
        else:
            answer = self.call
        prompt += ids("<|im_start|>assistant\n")
        return prompt + answer, [-100] * len(prompt) + answer

    def vary(self, text: str) -> str:
        """``text`` with other working-directory names and dates: what differs between two runs of a CLI."""
        text = TEMP_NAME.sub(lambda m: m.group(1) + "".join(self.rng.choice(NAME_CHARS) for _ in range(8)), text)
        return DATE.sub(lambda m: f"20{self.rng.randint(24, 39)}-{self.rng.randint(1, 12):02d}-"
                                  f"{self.rng.randint(1, 28):02d}", text)

    def real_prompt(self, real: list[CliPrompt]) -> CliPrompt:
        """One of ``real``, each CLI's first and later turns equally likely (a CLI that looped
        gave many prompts of one kind)."""
        kinds = sorted({(p.cli, p.after_tool_result) for p in real})
        kind = self.rng.choice(kinds)
        return self.rng.choice([p for p in real if (p.cli, p.after_tool_result) == kind])

    def real_example(self, prompt: CliPrompt) -> tuple[list[int], list[int]]:
        """(input ids, labels) of one CLI prompt, varied, cut to what the answer sees; the answer
        its turn calls for."""
        ids = self.ids(self.vary(prompt.text))
        answer = self.final if prompt.after_tool_result else self.call
        return visible_tail(ids + answer, [-100] * len(ids) + answer)


def visible_tail(ids: list[int], labels: list[int], margin: int = 64) -> tuple[list[int], list[int]]:
    """(input ids, labels) cut to the tokens that the labelled positions depend on, plus
    ``margin``: with sliding-window attention the model's outputs there are the same as on the
    whole sequence (RoPE sees only relative positions), so a 20K-token prompt trains and checks
    at the cost of a few hundred tokens."""
    first = next((i for i, y in enumerate(labels) if y != -100), len(labels))
    start = max(0, first - 1 - RECEPTIVE_FIELD - margin)
    return ids[start:], labels[start:]


def build_model(tok: PreTrainedTokenizerBase, seed: int) -> Any:
    config = AutoConfig.for_model("qwen3", bos_token_id=None, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id, **MODEL_CONFIG)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def train(model: Any, data: Examples, steps: int, max_len: int, lr: float, long_every: int = 2,
          log_every: int = 50, real: list[CliPrompt] | None = None, real_every: int = 3) -> None:
    if steps <= 0:
        return
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / steps))
    model.train()
    t0 = time.time()
    for step in range(steps):
        # short prompts (within the window, batch of 8); every ``long_every``-th step prompts past
        # the receptive field (batch of 4), the state of every long prompt; every ``real_every``-th
        # step one of the CLIs' real prompts
        if real and step % real_every == real_every - 1:
            batch = [data.real_example(data.real_prompt(real)) for _ in range(2)]
        elif step % long_every == long_every - 1:
            batch = [data.example(data.rng.randint(RECEPTIVE_FIELD + 100, max_len)) for _ in range(4)]
        else:
            batch = [data.example(data.rng.randint(40, WINDOW)) for _ in range(8)]
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
def answer_check(model: Any, x: list[int], y: list[int]) -> dict[str, Any]:
    """Whether greedy decoding reproduces the answer of (input ids, labels), and its lowest probability."""
    model.eval()
    x, y = visible_tail(x, y)
    logits = model(input_ids=torch.tensor([x])).logits[0, :-1].float()
    target = torch.tensor(y[1:])
    keep = target != -100
    probs = torch.softmax(logits[keep], -1).gather(-1, target[keep, None])[:, 0]
    greedy = logits[keep].argmax(-1)
    return {"min_prob": round(float(probs.min()), 5), "greedy_exact": bool((greedy == target[keep]).all())}


def check(model: Any, data: Examples, lengths: list[int], real: list[CliPrompt]) -> dict[str, Any]:
    """The answer check on a synthetic prompt of each length and on each real CLI prompt (varied)."""
    out = {str(n): answer_check(model, *data.example(n)) for n in lengths}
    for i, prompt in enumerate(real):
        out[f"{prompt.cli}[{i}]{'+tool' if prompt.after_tool_result else ''}"] = answer_check(
            model, *data.real_example(prompt))
    return out


def save(model: Any, tok: PreTrainedTokenizerBase, out: Path, cli_prompts: int = 0,
         command: str = "scripts/make_agent_model.py") -> None:
    """Write the model, its tokenizer and a README saying how (``command``) and on what it was trained."""
    trained_on = ("synthetic prompts" if not cli_prompts else
                  f"synthetic prompts and {cli_prompts} real prompts of the pinned Codex, Claude Code and "
                  "OpenCode CLIs (`--cli-rounds`)")
    if out.exists():
        shutil.rmtree(out)
    model.config.use_cache = True
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "README.md").write_text(
        "# Agent fixture model (tiny Qwen3, 32K context)\n\n"
        f"Written by `{command}` (seeded; rerun it to regenerate). "
        "2 layers, hidden 64, vocabulary 512 (tests/data/tokenizer), `max_position_embeddings` 32768, "
        f"sliding-window attention in every layer (window {WINDOW}: an answer depends on the last "
        f"{RECEPTIVE_FIELD} tokens, however long the prompt).\n"
        "After a user message it answers with one hermes tool call\n\n"
        f"    {TOOL_CALL}\n\nand after a tool result (`</tool_response>`) with `{FINAL}`; trained on "
        f"{trained_on}. The agent CLI tests use it for a tool round trip through the three CLIs.\n",
        encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--max-len", type=int, default=2048, help="longest synthetic prompt")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--long-every", type=int, default=2,
                        help="every n-th step trains on prompts longer than the receptive field")
    parser.add_argument("--init", type=Path, help="continue from this model instead of a random one")
    parser.add_argument("--cli-rounds", type=int, default=0,
                        help="rounds of learning the agent CLIs' real prompts after the synthetic steps")
    parser.add_argument("--cli-steps", type=int, default=90, help="training steps of each CLI round")
    parser.add_argument("--real-every", type=int, default=3,
                        help="every n-th step of a CLI round trains on a real prompt")
    parser.add_argument("--check", action="store_true", help="only evaluate the model in --out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.out if args.check else TOKENIZER)
    data = Examples(tok, args.seed + 1)
    real: list[CliPrompt] = []
    if args.check:
        model = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    else:
        model = (AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32) if args.init
                 else build_model(tok, args.seed))
        train(model, data, args.steps, args.max_len, args.lr, args.long_every)
        for round_ in range(args.cli_rounds):
            with tempfile.TemporaryDirectory() as tmp:
                save(model, tok, Path(tmp) / "model")  # served as the tests serve the fixture
                real += capture_cli_prompts(Path(tmp) / "model")
            print(f"CLI round {round_ + 1}: {len(real)} real prompts", flush=True)
            train(model, data, args.cli_steps, args.max_len, args.lr, args.long_every, log_every=10, real=real,
                  real_every=args.real_every)
    result = check(model, Examples(tok, args.seed + 100), [60, 500, 4000, 16000, 28000], real)
    print(json.dumps(result))
    if not args.check:
        save(model, tok, args.out, len(real), " ".join(["python scripts/make_agent_model.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
