"""Build the data and the partly-trained tiny vision-language model of the ``vision_count`` recipe.

* Pictures: Pillow-drawn, 32x32, 1 to 4 filled squares of one colour on white, each square 4 to 6
  pixels wide at a random place in its own 8x8 cell (so squares never touch), so there are far more
  distinct pictures than any file uses and every held-out picture is new. Questions: ``How many squares?`` (answer
  ``1`` .. ``4``) and ``Colour of the squares: r, g, b or y?`` (``r``ed, ``g``reen, ``b``lue,
  ``y``ellow); every answer is one token of the tokenizer, so the reward's gradient goes into the
  choice of answer, not into spelling it. Each row's prompt is one user message with the picture as
  a base64 data URL, as an agent sends it to the AgentFlow router.
* ``configs/recipes/vision_count/shapes_count.jsonl`` and ``shapes_colour.jsonl``: the training
  rows, one file (one ``[[data]]`` source) per question.
* ``configs/recipes/vision_count/heldout_count.jsonl`` and ``heldout_colour.jsonl``: the held-out
  evaluation, ``--heldout-rows`` pictures per question drawn with other seeds and never among the
  training or warm-start pictures; the asked labels are balanced (each answer a quarter of the
  rows), so a shift of the answer prior alone cannot raise held-out accuracy above chance.
* ``configs/recipes/vision_count/model/``: a tiny Qwen2-VL (``TINY_QWEN2_VL`` made twice as wide,
  see :func:`recipe_config`) with the tokenizer and image processor of tests/data/vlm, warm-started
  (``--epochs``) on other pictures whose answer is right with probability ``--right-prob`` and
  otherwise a random answer of the asked kind. With the default 0.4 the model learns the answer
  format and a reading of the pictures that it does not trust: its most likely answer is right on
  the held-out pictures, but it samples it only about half the time; turning that into answers is
  left to the RL run. ``--right-prob 0`` is a format-only warm start (the model samples each answer
  about a quarter of the time), ``--right-prob 1`` trains on the right answers. The loss is the
  expectation over such labels (:func:`partly_right_loss`), not a draw of them: the same minimum
  with far less gradient noise. The prompts are rendered to tokens by the router's own code (chat
  template, image placeholders) and the pixels by the image processor the engine and trainer use,
  so the warm start saw what a run shows the model.

Seeded, one CPU thread: ``python scripts/make_vision_count.py`` rewrites the same files.
"""

from __future__ import annotations

import argparse
import base64
import copy
import io
import json
import random
import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "configs" / "recipes" / "vision_count"
VLM = ROOT / "tests" / "data" / "vlm"
COLOURS = {"r": (220, 30, 30), "g": (30, 170, 30), "b": (30, 60, 220), "y": (230, 200, 20)}
QUESTIONS = {"count": ("How many squares?", ["1", "2", "3", "4"]),
             "colour": ("Colour of the squares: r, g, b or y?", sorted(COLOURS))}


def picture(count: int, colour: str, rng: random.Random) -> bytes:
    """A 32x32 PNG with ``count`` squares of ``colour`` on white: each square 4 to 6 pixels wide at a
    random place inside its own cell of a 4x4 grid of 8-pixel cells (so squares never touch, and
    each lies in one 8x8 block, the area one image token of the model covers)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (32, 32), "white")
    draw = ImageDraw.Draw(image)
    for cell in rng.sample(range(16), count):
        side = rng.randint(5, 7)
        x, y = cell % 4 * 8 + rng.randint(0, 7 - side), cell // 4 * 8 + rng.randint(0, 7 - side)
        draw.rectangle((x, y, x + side - 1, y + side - 1), fill=COLOURS[colour])
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def make_rows(n: int, seed: int, ask: str, exclude: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """``n`` seeded rows asking ``ask`` (``count`` or ``colour``), the asked answers balanced (row
    ``i`` has the ``i % 4``-th answer) and the other attribute random.

    A picture whose PNG is in ``exclude`` (base64 data URLs) is drawn again, so no picture repeats
    between files."""
    rng = random.Random(seed)
    question, answers = QUESTIONS[ask]
    rows: list[dict[str, Any]] = []
    seen = set(exclude)
    while len(rows) < n:
        label = answers[len(rows) % len(answers)]
        count = int(label) if ask == "count" else rng.randint(1, 4)
        colour = label if ask == "colour" else rng.choice(sorted(COLOURS))
        url = "data:image/png;base64," + base64.b64encode(picture(count, colour, rng)).decode()
        if url in seen:
            continue
        seen.add(url)
        rows.append({"prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                             {"type": "text", "text": question}]}],
                     "label": label})
    rng.shuffle(rows)
    return rows


def row_picture(row: dict[str, Any]) -> str:
    """The data URL of a row's picture."""
    return str(row["prompt"][0]["content"][0]["image_url"]["url"])


class Examples:
    """Rows rendered as the router renders them: prompt tokens, answer tokens, pixel inputs."""

    def __init__(self, tokenizer: Any, processor: Any) -> None:
        from loongsage_core.agentflow.images import ImageInputs
        from loongsage_core.agentflow.tito import ChatRenderer

        self.renderer = ChatRenderer(tokenizer)
        self.images = ImageInputs(processor, tokenizer)
        self.processor = processor
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def encode(self, row: dict[str, Any]) -> tuple[list[int], int, Any]:
        messages = [dict(m, content=[dict(p) for p in m["content"]]) for m in row["prompt"]]
        store: dict[str, str] = {}
        self.images.resolve(messages, store)
        prompt = self.renderer.prompt_tokens(messages)
        answer = self.renderer.encode(row["label"]) + [self.end]
        return prompt + answer, len(prompt), next(iter(store.values()))

    def batch(self, encoded: list[tuple[list[int], int, str]], image_token: int) -> dict[str, Any]:
        import torch
        from PIL import Image

        width = max(len(ids) for ids, _, _ in encoded)
        ids = torch.zeros(len(encoded), width, dtype=torch.long)
        attention = torch.zeros_like(ids)
        target = torch.zeros_like(ids, dtype=torch.bool)
        for i, (tokens, start, _) in enumerate(encoded):
            ids[i, :len(tokens)] = torch.tensor(tokens)
            attention[i, :len(tokens)] = 1
            target[i, start:len(tokens)] = True
        pictures = [Image.open(io.BytesIO(base64.b64decode(b))).convert("RGB") for _, _, b in encoded]
        px = self.processor(images=pictures, return_tensors="pt")
        types = ((ids == image_token) & (attention > 0)).int()
        return {"input_ids": ids, "attention_mask": attention, "pixel_values": px["pixel_values"],
                "image_grid_thw": px["image_grid_thw"], "mm_token_type_ids": types, "target": target}


def answer_logprob(model: Any, batch: dict[str, Any]) -> Any:
    """Per row, the log-probability of its whole answer (and the turn end) after its prompt."""
    import torch

    target = batch["target"]
    inputs = {k: v for k, v in batch.items() if k != "target"}
    logits = model(**inputs).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return (lp * target[:, 1:]).sum(1)


def recipe_config(tiny: dict[str, Any], width: int = 128) -> dict[str, Any]:
    """``TINY_QWEN2_VL`` twice as wide (``width``-wide text model and vision output, 16-wide
    attention heads; 0.5 M parameters, 2 MB): the 64-wide model stays at the answer prior for
    thousands of warm-start steps on these pictures, this one learns to read them in about a
    thousand."""
    conf = copy.deepcopy(tiny)
    conf["text_config"].update(hidden_size=width, intermediate_size=2 * width,
                               num_attention_heads=width // 16, num_key_value_heads=width // 32)
    conf["vision_config"].update(hidden_size=width, embed_dim=width // 2)
    return dict(conf)


def partly_right_loss(model: Any, batch: dict[str, Any], choices: Any, right: Any, right_prob: float) -> Any:
    """The warm start's loss: the expected negative log-likelihood of a label that is the right
    answer with probability ``right_prob`` and otherwise a uniformly random answer of the asked kind.

    ``choices`` holds each row's candidate answer tokens (one token each), ``right`` the index of the
    right one. Taking the expectation over the random labels (instead of drawing them) gives the
    same minimum, a model that puts ``right_prob + (1 - right_prob) / 4`` on the right answer when it
    reads the picture, with far less gradient noise; the turn end after the answer is learned as in
    plain fine-tuning."""
    import torch

    target = batch["target"][:, 1:]
    inputs = {k: v for k, v in batch.items() if k != "target"}
    lp = torch.log_softmax(model(**inputs).logits[:, :-1].float(), -1)
    rows = torch.arange(len(right))
    first = target.int().argmax(1)  # where each row's answer token is predicted
    token_lp = lp.gather(-1, batch["input_ids"][:, 1:, None])[..., 0] * target
    weights = torch.full(choices.shape, (1 - right_prob) / choices.shape[1])
    weights[rows, right] += right_prob
    answer = (lp[rows, first].gather(1, choices) * weights).sum(1)
    return -(answer + token_lp.sum(1) - token_lp[rows, first]).mean()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=1000, help="training rows per question")
    parser.add_argument("--warm-rows", type=int, default=1000, help="warm-start pictures per question")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--right-prob", type=float, default=0.4,
                        help="probability that a warm-start answer is the right one (else a random answer of "
                             "the asked kind): 0 teaches the answer format only, 1 the right answers")
    parser.add_argument("--heldout-rows", type=int, default=128, help="held-out rows per question (a multiple of 4)")
    args = parser.parse_args(argv)
    if not 0.0 <= args.right_prob <= 1.0:
        parser.error(f"--right-prob {args.right_prob} is not a probability")
    if args.heldout_rows % 4:
        parser.error(f"--heldout-rows {args.heldout_rows} is not a multiple of 4 (the held-out answers are balanced)")

    import torch
    from loongsage_plugin_torch.modeling import TINY_QWEN2_VL
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    OUT.mkdir(parents=True, exist_ok=True)
    seen: frozenset[str] = frozenset()
    files: dict[str, list[dict[str, Any]]] = {}
    for i, (prefix, n) in enumerate((("heldout", args.heldout_rows), ("shapes", args.rows), ("warm", args.warm_rows))):
        for j, ask in enumerate(QUESTIONS):
            files[f"{prefix}_{ask}"] = rows = make_rows(n, args.seed + 2 * i + j, ask, seen)
            seen = seen | {row_picture(r) for r in rows}
    for name, rows in files.items():
        if not name.startswith("warm"):
            (OUT / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    warm_rows = files["warm_count"] + files["warm_colour"]
    tokenizer = AutoTokenizer.from_pretrained(str(VLM))
    processor = AutoImageProcessor.from_pretrained(str(VLM))
    conf = recipe_config(TINY_QWEN2_VL)
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(conf.pop("model_type"), **conf))
    examples = Examples(tokenizer, processor)
    image_token = TINY_QWEN2_VL["image_token_id"]
    answers = {ask: [tokenizer.convert_tokens_to_ids(a) for a in QUESTIONS[ask][1]] for ask in QUESTIONS}
    warm = [(examples.encode(r), answers[ask], QUESTIONS[ask][1].index(r["label"]))
            for r in warm_rows for ask in ["count" if r["label"].isdigit() else "colour"]]
    held_out = {ask: files[f"heldout_{ask}"] for ask in QUESTIONS}
    candidates = {ask: [examples.batch([examples.encode(dict(r, label=a)) for r in rows], image_token)
                        for a in QUESTIONS[ask][1]] for ask, rows in held_out.items()}

    def accuracy() -> str:
        """Per question on the held-out rows: the expected accuracy of sampling at temperature 1 and
        the accuracy of the most likely answer."""
        parts = []
        with torch.no_grad():
            for ask, rows in held_out.items():
                lp = torch.stack([answer_logprob(model, batch) for batch in candidates[ask]], 1)
                right = torch.tensor([QUESTIONS[ask][1].index(r["label"]) for r in rows])
                sampled = float(lp.gather(1, right[:, None]).exp().mean())
                greedy = float((lp.argmax(1) == right).float().mean())
                parts.append(f"{ask} sampled {sampled:.3f} most-likely {greedy:.3f}")
        return ", ".join(parts)

    print(f"vision_count: before warm start, held-out accuracy: {accuracy()}", flush=True)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rng = random.Random(args.seed)
    for epoch in range(args.epochs):
        rng.shuffle(warm)
        losses = []
        for i in range(0, len(warm), 16):
            chunk = warm[i:i + 16]
            loss = partly_right_loss(model, examples.batch([e for e, _, _ in chunk], image_token),
                                     torch.tensor([c for _, c, _ in chunk]), torch.tensor([r for _, _, r in chunk]),
                                     args.right_prob)
            optim.zero_grad()
            loss.backward()
            optim.step()
            losses.append(float(loss.detach()))
        print(f"vision_count: epoch {epoch + 1} (right answers p={args.right_prob}), loss "
              f"{sum(losses) / len(losses):.3f}, held-out accuracy: "
              f"{accuracy()}", flush=True)
    model.save_pretrained(str(OUT / "model"))
    for f in VLM.iterdir():
        shutil.copy(f, OUT / "model" / f.name)
    print(f"wrote {OUT}: shapes_*.jsonl ({args.rows} rows per question), heldout_*.jsonl, model/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
