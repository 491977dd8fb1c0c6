"""Build the data and the warm-started tiny vision-language model of the ``vision_count`` recipe.

* ``configs/recipes/vision_count/shapes.jsonl``: Pillow-drawn pictures (32x32, 1 to 4 filled
  squares of one colour on white) with a question about them, either ``How many squares?``
  (answer ``1`` .. ``4``) or ``What colour are the squares?`` (``red``, ``green``, ``blue``,
  ``yellow``); each row's prompt is one user message with the picture as a base64 data URL, as an
  agent sends it to the AgentFlow router.
* ``configs/recipes/vision_count/model/``: a tiny Qwen2-VL (``TINY_QWEN2_VL``) with the tokenizer
  and image processor of tests/data/vlm, trained briefly on the right answers of other pictures
  (``--epochs``) so that it knows the answer format and samples the right answer some of the
  time; RL then has something to sharpen. The prompts are rendered to tokens by the router's own
  code (chat template, image placeholders) and the pixels by the image processor the engine and
  trainer use, so the warm start saw what a run shows the model.

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


def make_rows(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        count, colour = rng.randint(1, 4), rng.choice(sorted(COLOURS))
        png = picture(count, colour, rng)
        ask_count = rng.random() < 0.5
        question = "How many squares?" if ask_count else "What colour are the squares?"
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        rows.append({"prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                             {"type": "text", "text": question}]}],
                     "label": str(count) if ask_count else colour})
    return rows


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
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    import torch
    from loongsage_plugin_torch.modeling import TINY_QWEN2_VL
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    OUT.mkdir(parents=True, exist_ok=True)
    rows = make_rows(args.rows, args.seed)
    (OUT / "shapes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = AutoTokenizer.from_pretrained(str(VLM))
    processor = AutoImageProcessor.from_pretrained(str(VLM))
    conf = dict(TINY_QWEN2_VL)
    model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(conf.pop("model_type"), **conf))
    examples = Examples(tokenizer, processor)
    image_token = TINY_QWEN2_VL["image_token_id"]
    warm = [examples.encode(r) for r in make_rows(args.warm_rows, args.seed + 1)]
    held_out = examples.batch([examples.encode(r) for r in rows[:64]], image_token)

    def accuracy() -> float:
        """Expected exact-match accuracy of sampling at temperature 1 on held-out rows."""
        with torch.no_grad():
            return float(answer_logprob(model, held_out).exp().mean())

    print(f"vision_count: before warm start, expected sampled accuracy {accuracy():.3f}", flush=True)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rng = random.Random(args.seed)
    for epoch in range(args.epochs):
        rng.shuffle(warm)
        for i in range(0, len(warm), 16):
            loss = -answer_logprob(model, examples.batch(warm[i:i + 16], image_token)).mean()
            optim.zero_grad()
            loss.backward()
            optim.step()
        print(f"vision_count: epoch {epoch + 1}, expected sampled accuracy {accuracy():.3f}", flush=True)
    model.save_pretrained(str(OUT / "model"))
    for f in VLM.iterdir():
        shutil.copy(f, OUT / "model" / f.name)
    print(f"wrote {OUT / 'shapes.jsonl'} ({len(rows)} rows) and {OUT / 'model'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
