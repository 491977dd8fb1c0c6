"""Build the tokenizer and the warm-started tiny policy of the ``search`` recipe (configs/recipes/search/).

The recipe trains a deep-research agent: the ``tool_agent`` answers questions about a made-up
world (the ``fictional_qa`` data source) by calling ``search`` over the world's corpus
(``loongsage_plugin_agents.search_tools``). On a CPU the policy is a tiny Qwen3 built here:

1. **Tokenizer** (``configs/recipes/search/tokenizer/``): a byte-level BPE of ``--vocab-size``
   tokens, trained on transcripts of *other* made-up worlds (world seeds ``TOKENIZER_WORLDS``), so
   it splits every invented name, of the training split and of the held-out split alike, into
   syllable-sized pieces it learned from unrelated names. A space before a capital letter or a
   digit is a token of its own, so a name is the same tokens wherever it stands (after a space
   in a document, after a quote in a tool call, at the start of an answer). Its chat template
   (:data:`CHAT_TEMPLATE`) is ChatML with hermes tool calls, the tools listed one line each
   (``search(query): Search the documents.``) to keep the prompt short.
2. **Warm start** (``configs/recipes/search/model/``): two ``loongsage sft`` phases, as for the
   quickstart model. *Clean*: the recipe's ``warm_start.toml`` as it is, transcripts of the
   training split of many other worlds that are all right (``fictional_qa_sft`` with
   ``p_correct = 1``, ``worlds``, ``heldout_of`` the recipe's world), from a random
   initialisation of the model in that file, or from ``--from-model``: the policy learns the
   tool-call format, to copy the question's entity into ``search``, the second hop's entity out
   of the results, and a fact into the answer (names it has not seen: it cannot memorise them).
   *Noisy*: ``--noisy-steps`` more steps from that model on fresh transcripts of
   which only ``--p-correct`` are right, at ``--noisy-lr``; the rest are what ``warm_start.toml``'s
   ``wrong_answer`` says (``"entity"``: one search short, answering the name the missing search
   would have looked up). The policy keeps the skills but searches enough only some of the time,
   which is what RL has to select. Run it once the clean phase answers most held-out questions
   right (the check below says so), from that model with ``--clean-model``.

Then the recipe's held-out evaluation (``search.toml``'s ``[eval]``: the held-out split through
the real engine, router and ``tool_agent``) runs on the new model, as ``loongsage eval`` does, and
is printed.

Usage::

    python scripts/make_search_recipe.py                   # tokenizer + warm start + held-out check
    python scripts/make_search_recipe.py --tokenizer-only

Seeded and on one CPU thread, so the same arguments and the same world generator write the same
files. The shipped tokenizer was trained on transcripts of an earlier revision of the world
generator: rebuilding it (``--tokenizer``, or a run from a random start) today gives a different
vocabulary, so a model built from ``--from-model``/``--clean-model`` keeps the tokenizer that came
with it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "configs" / "recipes" / "search"
TEST_TOKENIZER = ROOT / "tests" / "data" / "tokenizer"
TOKENIZER_WORLDS = (1001, 1002, 1003, 1004)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
            "</tool_response>"]
NAME_SPACE = r" (?=[A-Z0-9])"
"""A space before a capital letter or a digit: split off as a token of its own."""

def hermes_chat_template(*, first_description_line: bool = False, compact_arguments: bool = False) -> str:
    """ChatML with hermes tool calls: the tools as ``name(params): description`` lines in the
    system turn, a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, a result as
    a user turn wrapped in ``<tool_response>``. ``first_description_line``: only the first line of
    each tool's description; ``compact_arguments``: arguments given as objects are written as
    compact JSON (no spaces), the way OpenCode sends them back."""
    description = ("f['description']" if not first_description_line
                   else "(f['description'] or '').split('\\n')[0]")
    arguments = "f['arguments'] | tojson" + ("(separators=(',', ':'))" if compact_arguments else "")
    return (
        "{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none %}"
        "{%- if system is not none or tools %}{{- '<|im_start|>system\\n' }}"
        "{%- if system is not none %}{{- system }}{%- if tools %}{{- '\\n' }}{%- endif %}{%- endif %}"
        "{%- if tools %}{{- 'Tools:' }}"
        "{%- for tool in tools %}{%- set f = tool['function'] if tool['function'] is defined else tool %}"
        "{{- '\\n' + f['name'] + '(' + (f['parameters']['properties'] | list | join(', ')) + '): '"
        " + " + description + " }}"
        "{%- endfor %}"
        "{{- '\\nCall one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>' }}{%- endif %}"
        "{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message['role'] == 'user' %}{{- '<|im_start|>user\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{%- elif message['role'] == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
        "{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
        "{%- for tc in message.get('tool_calls') or [] %}"
        "{%- set f = tc['function'] if tc['function'] is defined else tc %}"
        "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
        "{{- '<tool_call>{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
        "{%- if f['arguments'] is string %}{{- f['arguments'] }}"
        "{%- else %}{{- " + arguments + " }}{%- endif %}"
        "{{- '}</tool_call>' }}"
        "{%- endfor %}{{- '<|im_end|>\\n' }}"
        "{%- elif message['role'] == 'tool' %}"
        "{{- '<|im_start|>user\\n<tool_response>' + message['content'] + '</tool_response><|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )


CHAT_TEMPLATE = hermes_chat_template()
"""The recipe's chat template (:func:`hermes_chat_template`, full descriptions), baked into its
tokenizer."""


def tokenizer_corpus() -> list[str]:
    """Rendered transcripts (every behaviour) and the documents of the tokenizer's own worlds."""
    from loongsage_plugin_agents.fictional_transcripts import fictional_qa_transcripts
    from loongsage_plugin_agents.fictional_world import SPLITS, WorldSpec, build_world
    from transformers import AutoTokenizer

    renderer = AutoTokenizer.from_pretrained(str(TEST_TOKENIZER))
    texts: list[str] = []
    for seed in TOKENIZER_WORLDS:
        for split in SPLITS:
            texts += [d.text for d in build_world(WorldSpec(seed=seed), split).documents]
            for row in fictional_qa_transcripts(world={"seed": seed}, split=split, p_correct=0.5, seed=seed):
                texts.append(renderer.apply_chat_template(row["messages"], tools=row["tools"], tokenize=False,
                                                          chat_template=CHAT_TEMPLATE))
    return texts


def build_tokenizer(out: Path, vocab_size: int, corpus: list[str] | None = None, *, split: str = NAME_SPACE,
                    chat_template: str = CHAT_TEMPLATE) -> None:
    """Train a BPE tokenizer on ``corpus`` (default: the search recipe's, :func:`tokenizer_corpus`),
    each space matching ``split`` a piece of its own (default: a space before a capital or a digit),
    and write it with ``chat_template`` to ``out``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus if corpus is not None else tokenizer_corpus(), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "bos_token": None, "unk_token": None,
              "additional_special_tokens": SPECIALS[1:], "chat_template": chat_template}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {out} (vocabulary {tok.get_vocab_size()})", flush=True)


def run_phase(name: str, job: Any, work: Path) -> Path:
    """Run one ``loongsage sft`` phase of ``job``; prints its loss; returns its ``final_hf`` directory."""
    from loongsage_core.resolve import resolve_sft_job
    from loongsage_core.sft.run import run_sft

    out = work / name
    resolved = resolve_sft_job(job)
    history = run_sft(resolved.job, resolved.host, str(out))
    every = max(1, len(history) // 10)
    for i in range(every - 1, len(history), every):
        window = history[i + 1 - every:i + 1]
        evals = [m["sft/eval_loss"] for m in window if "sft/eval_loss" in m]
        print(f"  {name} step {i + 1}/{len(history)} loss {sum(m['sft/loss'] for m in window) / len(window):.3f}"
              + (f" eval_loss {evals[-1]:.3f}" if evals else ""), flush=True)
    return out / "final_hf"


def warm_start(args: argparse.Namespace, work: Path, recipe: Path = RECIPE) -> Path:
    """The clean phase (``recipe``'s ``warm_start.toml``), then the noisy one from its model (the same
    job with ``p_correct`` and ``seed`` of its first data source's generator set); returns the latter's model."""
    from loongsage_core.config import load_job

    clean = args.clean_model
    if clean is None:
        job = load_job(recipe / "warm_start.toml", list(args.overrides))
        if args.from_model is not None:  # continue that model: its config and tokenizer, not the file's
            job.model.path, job.model.config, job.model.tokenizer = str(args.from_model), {}, None
        clean = run_phase("clean", job, work)
    if args.noisy_steps == 0:
        return clean
    noisy = load_job(recipe / "warm_start.toml", list(args.overrides))
    noisy.model.path, noisy.model.config, noisy.model.tokenizer = str(clean), {}, None
    noisy.data[0].generator_args.update(p_correct=args.p_correct, seed=noisy.run.seed + 1)
    noisy.train.lr, noisy.train.lr_warmup_steps = args.noisy_lr, 0
    noisy.sft.max_steps = args.noisy_steps
    noisy.sft.eval_every = 0
    return run_phase("noisy", noisy, work)


def warm_start_parser(description: str, out: Path, *, eval_prompts: int, eval_samples: int) -> argparse.ArgumentParser:
    """The options every warm-start script of a recipe takes (this one's, the swe and opencode_learn
    recipes'): the tokenizer's size, where the model goes, the clean and noisy phases, the held-out
    check and ``key=value`` overrides of ``warm_start.toml``; a script adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=out, help="where the warm-started model goes")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the SFT runs here (default: a temp dir)")
    parser.add_argument("--from-model", type=Path, default=None,
                        help="run the clean phase from this model directory instead of a random initialisation")
    parser.add_argument("--clean-model", type=Path, default=None,
                        help="skip the clean phase: start the noisy one from this model directory")
    parser.add_argument("--p-correct", type=float, default=0.25, help="share of right transcripts when noisy")
    parser.add_argument("--noisy-steps", type=int, default=0, help="steps of the noisy phase (0: none)")
    parser.add_argument("--noisy-lr", type=float, default=2e-4, help="learning rate of the noisy phase")
    parser.add_argument("--eval-prompts", type=int, default=eval_prompts, help="held-out prompts to check (0: none)")
    parser.add_argument("--eval-samples", type=int, default=eval_samples)
    parser.add_argument("overrides", nargs="*", help="key=value overrides of warm_start.toml")
    return parser


def parse_warm_start_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser``'s arguments, the model directories absolute (job paths resolve against the job file)."""
    args = parser.parse_args(argv)
    args.from_model = args.from_model and args.from_model.resolve()
    args.clean_model = args.clean_model and args.clean_model.resolve()
    return args


def install_model(final: Path, out: Path, t0: float) -> None:
    """Put the warm-started model directory ``final`` at ``out`` (replacing what is there)."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(final, out)
    print(f"wrote {out} in {time.perf_counter() - t0:.0f}s", flush=True)


def heldout_check(args: argparse.Namespace, job_file: Path, overrides: Sequence[str] = ()) -> None:
    """With ``--eval-prompts``: the recipe's own ``[eval]`` (its held-out split, what
    ``loongsage eval`` runs) of ``job_file`` on the model at ``--out``, printed as a table."""
    if not args.eval_prompts:
        return
    from loongsage_core.config import load_job
    from loongsage_core.controller.eval_job import evaluate_job, format_table
    from loongsage_core.resolve import resolve_job

    job = load_job(job_file, [*overrides, f"eval.max_prompts={args.eval_prompts}", f"eval.samples={args.eval_samples}"])
    print(format_table(evaluate_job(resolve_job(job), checkpoint=str(args.out))), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = warm_start_parser(__doc__.split("\n\n")[0], RECIPE / "model", eval_prompts=64, eval_samples=4)
    parser.add_argument("--tokenizer-only", action="store_true", help="write the tokenizer and stop")
    parser.add_argument("--tokenizer", action="store_true",
                        help="rebuild the recipe's tokenizer/ too (a model continued with --from-model or"
                             " --clean-model keeps its own; a random initialisation always builds it)")
    args = parse_warm_start_args(parser, argv)

    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    if args.tokenizer or args.tokenizer_only or (args.from_model is None and args.clean_model is None):
        build_tokenizer(RECIPE / "tokenizer", args.vocab_size)
    if args.tokenizer_only:
        return 0
    with tempfile.TemporaryDirectory(prefix="search-sft-") as tmp:
        work = args.work_dir or Path(tmp)
        install_model(warm_start(args, work), args.out, t0)
    heldout_check(args, RECIPE / "search.toml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
