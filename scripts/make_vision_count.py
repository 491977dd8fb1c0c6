"""Build the data and the warm-started tiny vision-language model of the ``vision_count`` recipe.

* ``configs/recipes/vision_count/shapes.jsonl``: Pillow-drawn pictures (32x32, 1 to 4 filled
  squares of one colour on white) with a question about them, either ``How many squares?``
  (answer ``1`` .. ``4``) or ``What colour are the squares?`` (``red``, ``green``, ``blue``,
  ``yellow``); each row's prompt is one user message with the picture as a base64 data URL, as an
  agent sends it to the AgentFlow router.
* ``configs/recipes/vision_count/heldout_count.jsonl`` and ``heldout_colour.jsonl``: the held-out
  evaluation, 64 pictures each (other seeds than the training rows and the warm start), one
  question per file so each has its own curve.
* ``configs/recipes/vision_count/model/``: a tiny Qwen2-VL (``TINY_QWEN2_VL``) with the tokenizer
  and image processor of tests/data/vlm, warm-started (``--epochs``) on other pictures. By default
  (``--warm-start format``) each warm picture's answer is a random answer of the asked kind, so the
  model learns the answer format (a digit for the count, a colour name for the colour) and samples
  each answer about a quarter of the time, but has not learned to read the picture: what the RL run
  then gains is the reward's doing. ``--warm-start answers`` trains on the right answers instead
  (then the colour is mostly learned before RL starts and the count stays at chance). The prompts
  are rendered to tokens by the router's own code (chat template, image placeholders) and the
  pixels by the image processor the engine and trainer use, so the warm start saw what a run shows
  the model.

Seeded, one CPU thread: ``python scripts/make_vision_count.py`` rewrites the same files.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import shutil
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "configs" / "recipes" / "vision_count"
VLM = ROOT / "tests" / "data" / "vlm"
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220), "yellow": (230, 200, 20)}


def picture(count: int, colour: str, rng: random.Random) -> bytes:
    """A 32x32 PNG with ``count`` non-overlapping 7x7 squares of ``colour`` on white."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (32, 32), "white")
    draw = ImageDraw.Draw(image)
    cells = rng.sample([(x, y) for x in range(4) for y in range(4)], count)
    for x, y in cells:
        draw.rectangle((x * 8, y * 8, x * 8 + 6, y * 8 + 6), fill=COLOURS[colour])
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def make_rows(n: int, seed: int, ask: str = "either", exclude: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """``n`` seeded rows; ``ask`` is ``count``, ``colour`` or ``either`` (each row draws one).

    A picture whose PNG is in ``exclude`` (base64 data URLs) is drawn again: there are few distinct
    pictures with one or two squares, so another seed alone would repeat some of them."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    while len(rows) < n:
        count, colour = rng.randint(1, 4), rng.choice(sorted(COLOURS))
        png = picture(count, colour, rng)
        ask_count = rng.random() < 0.5 if ask == "either" else ask == "count"
        question = "How many squares?" if ask_count else "What colour are the squares?"
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        if url in exclude:
            continue
        rows.append({"prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                             {"type": "text", "text": question}]}],
                     "label": str(count) if ask_count else colour})
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=600, help="rows of the shipped data")
    parser.add_argument("--warm-rows", type=int, default=400, help="other pictures the warm start trains on")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warm-start", choices=("answers", "format"), default="format",
                        help="answers: the right answers of the warm pictures; format: a random answer of "
                             "the asked kind for each, so the model learns the answer format, not the pictures")
    parser.add_argument("--heldout-rows", type=int, default=64, help="held-out rows per question")
    args = parser.parse_args(argv)

    import torch
    from loongsage_plugin_torch.modeling import TINY_QWEN2_VL
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    OUT.mkdir(parents=True, exist_ok=True)
    rows = make_rows(args.rows, args.seed)
    (OUT / "shapes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    warm_rows = make_rows(args.warm_rows, args.seed + 1)
    seen = frozenset(row_picture(r) for r in rows + warm_rows)
    held_out_rows = {ask: make_rows(args.heldout_rows, args.seed + 2 + i, ask, seen)
                     for i, ask in enumerate(("count", "colour"))}
    for ask, held in held_out_rows.items():
        (OUT / f"heldout_{ask}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held))
    tokenizer = AutoTokenizer.from_pretrained(str(VLM))
    processor = AutoImageProcessor.from_pretrained(str(VLM))
    conf = dict(TINY_QWEN2_VL)
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(conf.pop("model_type"), **conf))
    examples = Examples(tokenizer, processor)
    image_token = TINY_QWEN2_VL["image_token_id"]
    if args.warm_start == "format":
        label_rng = random.Random(args.seed + 1)
        for row in warm_rows:
            kind = [str(n) for n in range(1, 5)] if row["label"].isdigit() else sorted(COLOURS)
            row["label"] = label_rng.choice(kind)
    warm = [examples.encode(r) for r in warm_rows]
    held_out = {ask: examples.batch([examples.encode(r) for r in held], image_token)
                for ask, held in held_out_rows.items()}

    def accuracy() -> str:
        """Expected exact-match accuracy of sampling at temperature 1 on the held-out rows, per question."""
        with torch.no_grad():
            return ", ".join(f"{ask} {float(answer_logprob(model, batch).exp().mean()):.3f}"
                             for ask, batch in held_out.items())

    print(f"vision_count: before warm start, expected sampled accuracy: {accuracy()}", flush=True)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rng = random.Random(args.seed)
    for epoch in range(args.epochs):
        rng.shuffle(warm)
        for i in range(0, len(warm), 16):
            loss = -answer_logprob(model, examples.batch(warm[i:i + 16], image_token)).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
        print(f"vision_count: epoch {epoch + 1} ({args.warm_start}), expected sampled accuracy: {accuracy()}",
              flush=True)
    model.save_pretrained(str(OUT / "model"))
    for f in VLM.iterdir():
        shutil.copy(f, OUT / "model" / f.name)
    print(f"wrote {OUT / 'shapes.jsonl'} ({len(rows)} rows) and {OUT / 'model'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
