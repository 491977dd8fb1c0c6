"""Build the learning job of the ``swe`` recipe: its tasks, its tokenizer and its warm-started tiny policy.

Everything lands in configs/recipes/swe/ (the job is ``repair.toml``):

1. **Tasks** (``mini/train.jsonl``, ``mini/heldout.jsonl``, ``mini/repos/*.tar.gz``): the generated
   one-function repositories of ``loongsage_plugin_agents.swe_mini`` (``--train-tasks`` of the
   training split, ``--heldout-tasks`` of the held-out one, whose words no training repository or
   transcript uses), as SWE-bench-shaped rows with ``FAIL_TO_PASS`` / ``PASS_TO_PASS`` measured by
   running their tests on the buggy and on the fixed code (``make_swe_tasks.build_row``, the same
   as the hand-written tasks). Deterministic: the same arguments write the same bytes.
2. **Tokenizer** (``tokenizer/``): a byte-level BPE of ``--vocab-size`` tokens trained on rendered
   repair transcripts of *other* seeds (``TOKENIZER_SEEDS``), with the search recipe's compact
   chat template (``make_search_recipe.CHAT_TEMPLATE``: the tools one line each).
3. **Warm start** (``model/``): ``warm_start.toml``'s clean ``loongsage sft`` phase (all edits
   right), then a noisy phase (``--noisy-steps``, ``--p-correct`` of the edits right, the rest the
   bug's wrong fix), the two phases of ``make_search_recipe.warm_start``.
4. **Held-out check**: ``repair.toml``'s ``[eval]`` (the held-out repositories through the real
   engine, router, ``tool_agent``, ``local`` sandbox and ``swe_tests``) on the new model.

Usage::

    python scripts/make_swe_mini.py --tasks-only             # the task files only (seconds)
    python scripts/make_swe_mini.py                          # tasks, tokenizer, clean phase, held-out check
    python scripts/make_swe_mini.py --clean-model runs/clean --noisy-steps 100   # the noisy phase -> model/

Seeded, on one CPU thread.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "configs" / "recipes" / "swe"
MINI = RECIPE / "mini"
TOKENIZER_SEEDS = (1001, 1002)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_search_recipe import (  # noqa: E402
    CHAT_TEMPLATE,
    TEST_TOKENIZER,
    build_tokenizer,
    heldout_check,
    install_model,
    parse_warm_start_args,
    warm_start,
    warm_start_parser,
)
from make_swe_tasks import build_row  # noqa: E402
from swe_task_specs import Spec  # noqa: E402


def write_tasks(out: Path, train: int, heldout: int, seed: int = 0) -> dict[str, int]:
    """Write ``train.jsonl``, ``heldout.jsonl`` and ``repos/`` under ``out``; returns the row counts."""
    from loongsage_plugin_agents.swe_mini import mini_repos

    (out / "repos").mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, num in (("train", train), ("heldout", heldout)):
        rows = []
        for repo in mini_repos(split, num, seed=seed):
            tests = {p: t for p, t in repo.files.items() if p.startswith("tests/")}
            spec = Spec(name=repo.name, bug=repo.bug, problem=repo.problem, files={repo.path: repo.files[repo.path]},
                        tests=tests, hidden_tests=repo.hidden_tests, fix=[(repo.path, repo.buggy, repo.fix)])
            row, tar = build_row(spec)
            (out / "repos" / f"{repo.name}.tar.gz").write_bytes(tar)
            rows.append({**row, "split": split})
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
        counts[split] = len(rows)
    return counts


def tokenizer_corpus() -> list[str]:
    """Rendered repair transcripts (right and wrong fixes) of the tokenizer's own seeds."""
    from loongsage_plugin_agents.swe_mini import mini_repair_transcripts
    from transformers import AutoTokenizer

    renderer = AutoTokenizer.from_pretrained(str(TEST_TOKENIZER))
    return [renderer.apply_chat_template(row["messages"], tools=row["tools"], tokenize=False,
                                         chat_template=CHAT_TEMPLATE)
            for seed in TOKENIZER_SEEDS for row in mini_repair_transcripts(seed=seed, num_samples=500,
                                                                            p_correct=0.5)]


def main(argv: list[str] | None = None) -> int:
    parser = warm_start_parser(__doc__.split("\n\n")[0], RECIPE / "model", eval_prompts=32, eval_samples=4)
    parser.add_argument("--tasks-only", action="store_true", help="write the task files and stop")
    parser.add_argument("--train-tasks", type=int, default=64)
    parser.add_argument("--heldout-tasks", type=int, default=32)
    args = parse_warm_start_args(parser, argv)

    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    print(json.dumps(write_tasks(MINI, args.train_tasks, args.heldout_tasks)), flush=True)
    if args.tasks_only:
        return 0
    if args.from_model is None and args.clean_model is None:
        build_tokenizer(RECIPE / "tokenizer", args.vocab_size, tokenizer_corpus())
    with tempfile.TemporaryDirectory(prefix="swe-sft-") as tmp:
        install_model(warm_start(args, args.work_dir or Path(tmp), recipe=RECIPE), args.out, t0)
    heldout_check(args, RECIPE / "repair.toml", [f"model.path={args.out.resolve()}"])  # held-out repositories
    return 0


if __name__ == "__main__":
    sys.exit(main())
