"""Build the data and tiny models of the ``math_dapo`` and ``mopd`` recipes (configs/recipes/).

Both start from the warm-started quickstart model (configs/quickstart/model, built by
``scripts/make_quickstart_model.py``), which knows single-digit addition and subtraction in the
form ``What is 7 - 2?``. Fine-tuning it (with ``loongsage sft``, through
``make_quickstart_model.finetune``) for a few epochs is enough to give each recipe a model
that samples some right answers (so the reward is not stuck at 0) and leaves room to learn.

``math_dapo`` (``--only math_dapo``):
    * ``configs/recipes/math_dapo/word_problems.jsonl``: short word problems with a numeric answer
      (``{"prompt", "label"}`` rows), e.g. ``Ann has 7 pens and loses 2. How many pens now?`` ->
      ``5``, graded by the ``math_verify`` reward;
    * ``configs/recipes/math_dapo/model/``: the quickstart model fine-tuned on those problems with
      right answers (``--clean-epochs``), then with only a ``--p-correct`` share of right targets
      (the rest random numbers of the answer range, ``--noisy-epochs``), so it learns the format
      and ranks the right answer high without reliably sampling it.

``mopd`` (``--only mopd``):
    * ``configs/recipes/mopd/teacher_add/`` and ``teacher_sub/``: the quickstart model trained
      further on right answers only, one on additions and one on subtractions. Each teacher is
      much better than the student (the quickstart model) on its own task; the recipe routes each
      data source to its teacher.

``sft`` (``--only sft``):
    * ``configs/recipes/sft_data/word_problems_chat.jsonl``: the data of the SFT recipe
      (``configs/recipes/sft.toml``): chats of one or two word problems (``{"messages": [...]}``
      rows, user question then the bare answer), drawn from the same problem generator.

``moe_r3`` (``--only moe_r3``):
    * ``configs/recipes/moe_r3/model/``: the quickstart model *upcycled* into a Qwen3-MoE (each
      decoder layer's MLP copied into ``--moe-experts`` experts, each copy perturbed by
      ``--moe-noise`` of its weights' spread so that the experts differ, and a fresh top-2 router
      of small weights, ``--moe-router-std``),
      the tiny mixture-of-experts policy of the Router Replay recipe. Its experts start nearly
      alike, so it keeps the quickstart model's arithmetic, and its router's choices are close
      calls that a bfloat16 engine and a float32 trainer often make differently.

Everything is seeded and runs on one CPU thread: the same arguments rewrite the same files.

Usage::

    python scripts/make_recipe_models.py                  # both recipes
    python scripts/make_recipe_models.py --only mopd
    python scripts/make_recipe_models.py --only sft       # the SFT recipe's chat data only
    python scripts/make_recipe_models.py --only moe_r3    # the Router Replay recipe's model
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

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "configs" / "quickstart" / "model"
RECIPES = ROOT / "configs" / "recipes"

NAMES = ("Ann", "Bob", "Sam", "Eve")
ITEMS = ("pens", "cats", "cups", "eggs")


def word_problem(rng: random.Random) -> dict[str, Any]:
    """One problem: ``a`` things, then ``b`` more (addition) or ``b`` fewer (subtraction, ``b <= a``)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    if rng.random() < 0.5:
        text, answer = f"{name} has {a} {item} and gets {b} more. How many {item} now?", a + b
    else:
        a, b = max(a, b), min(a, b)
        text, answer = f"{name} has {a} {item} and loses {b}. How many {item} now?", a - b
    return {"prompt": text, "label": str(answer)}


def word_problems(num: int, seed: int) -> list[dict[str, Any]]:
    """``num`` distinct problems (fewer if the templates run out), in a seeded order."""
    rng = random.Random(seed)
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(num * 20):
        row = word_problem(rng)
        seen.setdefault(row["prompt"], row)
        if len(seen) == num:
            break
    return list(seen.values())


def _sft_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows in the shape the quickstart warm start trains on (``metadata["answer"]`` an int)."""
    return [{"prompt": r["prompt"], "label": r["label"], "metadata": {"answer": int(r["label"])}} for r in rows]


def _save(model: Any, tok: Any, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    print(f"wrote {out}", flush=True)


def build_sft_data(args: argparse.Namespace) -> None:
    """Write the chat data of the SFT recipe: ``--sft-chats`` conversations of one or two problems."""
    rng = random.Random(args.seed + 7)
    problems = word_problems(args.num_problems, args.seed + 7)
    out = RECIPES / "sft_data" / "word_problems_chat.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for _ in range(args.sft_chats):
            messages = []
            for row in rng.sample(problems, rng.choice((1, 2))):
                messages += [{"role": "user", "content": row["prompt"]},
                             {"role": "assistant", "content": row["label"]}]
            f.write(json.dumps({"messages": messages}) + "\n")
    print(f"wrote {args.sft_chats} chats to {out}", flush=True)


def build_math_dapo(mq: Any, args: argparse.Namespace) -> None:
    """Write the word-problem set and the warm-started model of the ``math_dapo`` recipe."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = RECIPES / "math_dapo"
    rows = word_problems(args.num_problems, args.seed)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "word_problems.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} problems to {out / 'word_problems.jsonl'}", flush=True)

    tok = AutoTokenizer.from_pretrained(str(QUICKSTART))
    train = _sft_rows(rows[:args.sft_problems])
    with tempfile.TemporaryDirectory(prefix="math-dapo-sft-") as tmp:
        clean = mq.finetune("clean", train, Path(tmp), model={"path": str(QUICKSTART)}, p_correct=1.0,
                            epochs=args.clean_epochs, lr=args.lr, batch_size=32, seed=args.seed)
        noisy = mq.finetune("noisy", train, Path(tmp), model={"path": str(clean)}, p_correct=args.p_correct,
                            epochs=args.noisy_epochs, lr=args.noisy_lr, batch_size=32, seed=args.seed + 3)
        model = AutoModelForCausalLM.from_pretrained(str(noisy))
    held_out = _sft_rows(rows[-64:])
    print("math_dapo student:", json.dumps(mq.evaluate(model, tok, held_out, samples=4, max_new_tokens=8,
                                                      seed=args.seed + 1)), flush=True)
    _save(model, tok, out / "model")


def build_mopd(mq: Any, args: argparse.Namespace) -> None:
    """Write the two teachers of the ``mopd`` recipe, one per arithmetic operation."""
    from loongsage_plugin_rewards.sources.arithmetic import arithmetic_rows
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(QUICKSTART))
    for name, op in (("teacher_add", "+"), ("teacher_sub", "-")):
        rows = arithmetic_rows(num_samples=2000, seed=0, digits=1, num_operands=2, ops=op)
        questions = list({r["prompt"]: r for r in rows}.values())
        model = AutoModelForCausalLM.from_pretrained(str(QUICKSTART))
        before = mq.evaluate(model, tok, questions, samples=2, max_new_tokens=8, seed=args.seed + 1)
        with tempfile.TemporaryDirectory(prefix=f"{name}-sft-") as tmp:
            trained = mq.finetune(name, questions, Path(tmp), model={"path": str(QUICKSTART)}, p_correct=1.0,
                                  epochs=args.teacher_epochs, lr=args.teacher_lr, batch_size=32, seed=args.seed)
            model = AutoModelForCausalLM.from_pretrained(str(trained))
        after = mq.evaluate(model, tok, questions, samples=2, max_new_tokens=8, seed=args.seed + 1)
        print(f"{name} ({op}): student {json.dumps(before)} -> teacher {json.dumps(after)}", flush=True)
        _save(model, tok, RECIPES / "mopd" / name)


def upcycle(dense: Any, *, experts: int, top_k: int, noise: float, router_std: float, seed: int) -> Any:
    """A Qwen3-MoE copy of the dense Qwen3 ``dense``: attention, norms and embeddings as they are;
    every layer's MLP copied into ``experts`` experts (gate and up stacked, as transformers keeps
    them), each copy plus Gaussian noise of ``noise`` times that weight's standard deviation;
    a router initialised with standard deviation ``router_std``, renormalised top-``top_k``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = dense.config.to_dict()
    for key in ("architectures", "model_type", "transformers_version", "dtype", "torch_dtype"):
        cfg.pop(key, None)
    cfg.update(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=dense.config.intermediate_size,
               decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False)
    torch.manual_seed(seed)
    moe = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**cfg), dtype=torch.float32)
    missing, unexpected = moe.load_state_dict(dense.state_dict(), strict=False)
    assert not [k for k in unexpected if ".mlp." not in k], unexpected
    gen = torch.Generator().manual_seed(seed)

    def noisy(weight: Any) -> Any:
        copies = weight.detach().float().expand(experts, *weight.shape).clone()
        return copies + torch.randn(copies.shape, generator=gen) * noise * float(weight.float().std())

    with torch.no_grad():
        for dense_layer, layer in zip(dense.model.layers, moe.model.layers):
            mlp = dense_layer.mlp
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0)
            layer.mlp.experts.gate_up_proj.copy_(noisy(gate_up))
            layer.mlp.experts.down_proj.copy_(noisy(mlp.down_proj.weight))
            layer.mlp.gate.weight.normal_(0.0, router_std, generator=gen)
    moe.generation_config = dense.generation_config
    return moe


def build_moe_r3(mq: Any, args: argparse.Namespace) -> None:
    """Write the upcycled mixture-of-experts policy of the ``moe_r3`` recipe."""
    from loongsage_plugin_rewards.sources.arithmetic import arithmetic_rows
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(QUICKSTART))
    dense = AutoModelForCausalLM.from_pretrained(str(QUICKSTART))
    moe = upcycle(dense, experts=args.moe_experts, top_k=2, noise=args.moe_noise, router_std=args.moe_router_std,
                  seed=args.seed)
    rows = arithmetic_rows(num_samples=256, seed=1, digits=1, num_operands=2, ops="+-")
    before = mq.evaluate(dense, tok, rows, samples=2, max_new_tokens=8, seed=args.seed + 1)
    after = mq.evaluate(moe, tok, rows, samples=2, max_new_tokens=8, seed=args.seed + 1)
    print(f"moe_r3: dense {json.dumps(before)} -> upcycled {json.dumps(after)}", flush=True)
    _save(moe, tok, RECIPES / "moe_r3" / "model")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("math_dapo", "mopd", "sft", "moe_r3"), help="build one recipe's files only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-problems", type=int, default=2000, help="word problems in the shipped set")
    parser.add_argument("--sft-problems", type=int, default=1200, help="problems the student is fine-tuned on")
    parser.add_argument("--clean-epochs", type=int, default=6, help="epochs on right answers only")
    parser.add_argument("--noisy-epochs", type=int, default=1, help="epochs on partly random answers")
    parser.add_argument("--p-correct", type=float, default=0.3, help="share of right targets when noisy")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of the clean phase")
    parser.add_argument("--noisy-lr", type=float, default=3e-4, help="peak learning rate of the noisy phase")
    parser.add_argument("--sft-chats", type=int, default=400, help="conversations of the SFT recipe's data")
    parser.add_argument("--teacher-epochs", type=int, default=20)
    parser.add_argument("--teacher-lr", type=float, default=1e-3)
    parser.add_argument("--moe-experts", type=int, default=4, help="experts per layer of the moe_r3 model")
    parser.add_argument("--moe-noise", type=float, default=1.0, help="expert perturbation, in weight std units")
    parser.add_argument("--moe-router-std", type=float, default=0.005,
                        help="spread of the fresh router's weights (smaller: closer calls between experts)")
    args = parser.parse_args(argv)

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import make_quickstart_model as mq

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    if args.only in (None, "math_dapo"):
        build_math_dapo(mq, args)
    if args.only in (None, "mopd"):
        build_mopd(mq, args)
    if args.only in (None, "sft"):
        build_sft_data(args)
    if args.only in (None, "moe_r3"):
        build_moe_r3(mq, args)
    print(f"done in {time.perf_counter() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
