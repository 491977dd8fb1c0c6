"""Build the tasks, tokenizer and warm-started tiny policy of the ``opencode_learn`` recipe.

The recipe (configs/recipes/opencode_learn/) trains the real OpenCode CLI's policy on tasks it
solves with its own ``write`` tool: "Create the file NAME containing exactly: TEXT", checked in
the sandbox by ``swe_tests`` (a generated unittest reads the file). The job's ``agent_args.config``
gives OpenCode's default agent a short prompt and only the tools the task needs, so every request
OpenCode sends is a few hundred tokens, not its default ~20K. This script writes:

1. **Tasks** (``train.jsonl``, ``heldout.jsonl``): names and contents made of invented words; the
   words of the two splits are disjoint, and the tokenizer's own words are a third set.
2. **Tokenizer** (``tokenizer/``): a byte-level BPE of ``--vocab-size`` tokens trained on rendered
   transcripts of the third word set (every space a token of its own, so a word is the same tokens
   after a space in the task and after a quote in the tool call), with :data:`CHAT_TEMPLATE`
   (ChatML, hermes tool calls, each tool one line: its name, its parameters and the first line of
   its description).
3. **Warm start** (``model/``): ``loongsage sft`` of a tiny Qwen3 (``warm_start.toml``) on
   transcripts in OpenCode's own request format (:func:`transcript`: its system prompt with the
   recipe's agent prompt and a varying working directory and date, the user turn as OpenCode
   quotes it, the ``write`` call with OpenCode's argument order and compact JSON, its tool result,
   the final answer; the tool schemas are ``opencode_tools.json``, captured from OpenCode's
   requests): a *clean* phase, all right, then a *noisy* phase (``--noisy-steps``) where only
   ``--p-correct`` of them are; the rest write the file without its extension (``velor_kint``
   for ``velor_kint.txt``), so RL has one behaviour to select.

Then the recipe's ``[eval]`` (the held-out split through the real router, OpenCode and sandboxes)
runs on the new model, as ``loongsage eval`` does. Seeded, one CPU thread.

Usage::

    python scripts/make_opencode_learn_recipe.py                 # tasks, tokenizer, clean + noisy phases, check
    python scripts/make_opencode_learn_recipe.py --tasks-only
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "configs" / "recipes" / "opencode_learn"
TEST_TOKENIZER = ROOT / "tests" / "data" / "tokenizer"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_search_recipe as search_recipe  # noqa: E402  (the tokenizer trainer and the sft phase runner)

AGENT_PROMPT = ("You create files. Call the write tool once with the file name and the exact content, "
                "then answer Done.")
"""The recipe's ``agent.build.prompt`` (``opencode_learn.toml``): OpenCode puts it first in its system prompt."""
MODEL_NAME = "policy"
EXTENSIONS = ("txt",)
"""The files' extension: one, since the warm start does not learn to copy it (it guesses among several)."""
ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "tr", "sh")
VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
CODAS = ("", "", "", "n", "l", "r", "s", "k")
WORLD_SEEDS = {"train": 1, "heldout": 2, "tokenizer": 3}

CHAT_TEMPLATE = search_recipe.hermes_chat_template(first_description_line=True, compact_arguments=True)
"""ChatML with hermes tool calls (arguments as compact JSON, the way OpenCode sends them back);
each tool one line, ``name(params): first line of its description``
(OpenCode's own descriptions run to paragraphs), to keep the prompt short."""


def words(split: str, count: int = 600) -> list[str]:
    """``count`` invented lowercase words of a split (two or three syllables); splits share none."""
    taken: set[str] = set()
    for other, seed in WORLD_SEEDS.items():
        if other != split:
            taken |= set(_raw_words(seed, count))
    return [w for w in _raw_words(WORLD_SEEDS[split], count) if w not in taken]


def _raw_words(seed: int, count: int) -> list[str]:
    rng = random.Random(f"opencode-learn-words-{seed}")
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < count:
        word = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
                       for _ in range(rng.choice((2, 2, 3))))
        if word not in seen and 4 <= len(word) <= 10:
            seen.add(word)
            out.append(word)
    return out


def make_task(rng: random.Random, vocab: list[str]) -> tuple[str, str]:
    """A file name (``word_word.ext``) and a content (two to four words)."""
    name = f"{rng.choice(vocab)}_{rng.choice(vocab)}.{rng.choice(EXTENSIONS)}"
    return name, " ".join(rng.choice(vocab) for _ in range(rng.randint(2, 4)))


def prompt_for(name: str, text: str) -> str:
    return f"Create the file {name} containing exactly: {text}"


def task_rows(split: str, count: int, seed: int) -> list[dict[str, Any]]:
    """Rows for the ``swe_tests`` reward: the prompt, and a unittest that checks the file exactly."""
    rng = random.Random(f"opencode-learn-tasks-{split}-{seed}")
    vocab = words(split)
    rows = []
    for i in range(count):
        name, text = make_task(rng, vocab)
        test = ("import unittest\n\n\nclass TestTask(unittest.TestCase):\n    def test_file(self):\n"
                f"        with open({name!r}, encoding='utf-8') as f:\n"
                f"            self.assertEqual(f.read().rstrip('\\n'), {text!r})\n")
        rows.append({"instance_id": f"opencode-learn-{split}-{i:04d}", "problem_statement": prompt_for(name, text),
                     "file": name, "content": text, "test_cmd": "python3 -m unittest -v",
                     "test_files": {"test_task.py": test}, "FAIL_TO_PASS": ["test_task.TestTask.test_file"],
                     "PASS_TO_PASS": []})
    return rows


def system_prompt(workdir: str, date: str) -> str:
    """OpenCode's system prompt for the recipe's agent (as its requests carry it) in ``workdir`` on ``date``."""
    return (f"{AGENT_PROMPT}\nYou are powered by the model named {MODEL_NAME}. The exact model ID is "
            f"loongsage/{MODEL_NAME}\nHere is some useful information about the environment you are running in:\n"
            f"<env>\n  Working directory: {workdir}\n  Workspace root folder: /\n  Is directory a git repo: no\n"
            f"  Platform: linux\n  Today's date: {date}\n</env>")


def random_system_prompt(rng: random.Random) -> str:
    """:func:`system_prompt` with a sandbox-like working directory and a date drawn at random: the
    parts that differ per run, so the policy learns to ignore them."""
    workdir = (f"/tmp/loongsage-sandboxes/{rng.randrange(16**8):08x}--{rng.randrange(16**12):012x}-"
               f"{rng.randrange(10**4)}-{''.join(rng.choice(string.ascii_lowercase + string.digits) for _ in range(8))}"
               f"/work")
    day = time.gmtime(1_700_000_000 + rng.randrange(3 * 365) * 86400)
    return system_prompt(workdir, time.strftime("%a %b %d %Y", day))


def transcript(rng: random.Random, name: str, text: str, right: bool) -> list[dict[str, Any]]:
    """One OpenCode session as its requests carry it; a wrong one writes the name without its extension."""
    path = name if right else name.rsplit(".", 1)[0]
    call_id = f"call_{rng.randrange(16**8):08x}"
    arguments = json.dumps({"filePath": path, "content": text}, separators=(",", ":"))
    return [
        {"role": "system", "content": random_system_prompt(rng)},
        {"role": "user", "content": f'"{prompt_for(name, text)}"'},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "write", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "Wrote file successfully."},
        {"role": "assistant", "content": "Done."},
    ]


def fresh_words(seed: int, avoid: set[str]) -> Any:
    """An endless supply of invented words outside ``avoid``: a transcript's names are new to the
    policy, so it learns to copy them rather than memorise a word list."""
    rng = random.Random(f"opencode-learn-fresh-{seed}")
    while True:
        syllables = rng.choice((2, 2, 3))
        word = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables))
        if 4 <= len(word) <= 10 and word not in avoid:
            yield word


def transcripts(split: str, count: int, seed: int, p_correct: float) -> list[dict[str, Any]]:
    """Warm-start transcripts; ``split="train"`` draws fresh words (never a held-out one) for each."""
    tools = json.loads((RECIPE / "opencode_tools.json").read_text())
    rng = random.Random(f"opencode-learn-sft-{split}-{seed}")
    rows = []
    if split == "train":
        supply = fresh_words(seed, set(words("heldout")))
    else:
        vocab = words(split)
        supply = iter(lambda: rng.choice(vocab), None)
    for _ in range(count):
        name = f"{next(supply)}_{next(supply)}.{rng.choice(EXTENSIONS)}"
        text = " ".join(next(supply) for _ in range(rng.randint(2, 4)))
        rows.append({"messages": transcript(rng, name, text, rng.random() < p_correct), "tools": tools})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def build_tokenizer(out: Path, vocab_size: int) -> None:
    """The recipe's tokenizer: byte-level BPE trained on transcripts of the tokenizer's own words
    (never a held-out one), every space a piece of its own, with :data:`CHAT_TEMPLATE`."""
    from transformers import AutoTokenizer

    renderer = AutoTokenizer.from_pretrained(str(TEST_TOKENIZER))
    texts = [renderer.apply_chat_template(r["messages"], tools=r["tools"], tokenize=False, chat_template=CHAT_TEMPLATE)
             for r in transcripts("tokenizer", 3000, 0, 0.5)]
    search_recipe.build_tokenizer(out, vocab_size, texts, split=" ", chat_template=CHAT_TEMPLATE)


def phase_job(args: argparse.Namespace, work: Path, name: str, p_correct: float, seed: int, rows: int) -> Any:
    from loongsage_core.config import load_job

    data = work / f"{name}.jsonl"
    write_jsonl(data, transcripts("train", rows, seed, p_correct))
    job = load_job(RECIPE / "warm_start.toml", [f"data.0.path={data}", *args.overrides])
    return job


def warm_start(args: argparse.Namespace, work: Path) -> Path:
    clean = args.clean_model
    if clean is None:
        job = phase_job(args, work, "clean", 1.0, args.seed, args.clean_rows)
        if args.from_model is not None:
            job.model.path, job.model.config, job.model.tokenizer = str(args.from_model), {}, None
        clean = search_recipe.run_phase("clean", job, work)
    if args.noisy_steps == 0:
        return clean
    noisy = phase_job(args, work, "noisy", args.p_correct, args.seed + 1, args.noisy_steps * 16)
    noisy.model.path, noisy.model.config, noisy.model.tokenizer = str(clean), {}, None
    noisy.train.lr, noisy.train.lr_warmup_steps = args.noisy_lr, 0
    noisy.sft.max_steps, noisy.sft.eval_every = args.noisy_steps, 0
    return search_recipe.run_phase("noisy", noisy, work)


def main(argv: list[str] | None = None) -> int:
    parser = search_recipe.warm_start_parser(__doc__.split("\n\n")[0], RECIPE / "model", eval_prompts=32,
                                             eval_samples=2)
    parser.add_argument("--tasks-only", action="store_true", help="write train.jsonl and heldout.jsonl and stop")
    parser.add_argument("--train-tasks", type=int, default=256)
    parser.add_argument("--heldout-tasks", type=int, default=64)
    parser.add_argument("--clean-rows", type=int, default=8000, help="transcripts of the clean phase")
    parser.add_argument("--seed", type=int, default=0, help="seed of the transcripts")
    args = search_recipe.parse_warm_start_args(parser, argv)

    write_jsonl(RECIPE / "train.jsonl", task_rows("train", args.train_tasks, 0))
    write_jsonl(RECIPE / "heldout.jsonl", task_rows("heldout", args.heldout_tasks, 0))
    # a small sample, so that warm_start.toml runs as it is (the phases below write their own)
    write_jsonl(RECIPE / "transcripts.jsonl", transcripts("train", 16, 0, 1.0))
    if args.tasks_only:
        return 0
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    if args.from_model is None and args.clean_model is None:
        build_tokenizer(RECIPE / "tokenizer", args.vocab_size)
    with tempfile.TemporaryDirectory(prefix="opencode-learn-sft-") as tmp:
        work = args.work_dir.resolve() if args.work_dir else Path(tmp)
        search_recipe.install_model(warm_start(args, work), args.out, t0)
    search_recipe.heldout_check(args, RECIPE / "opencode_learn.toml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
