"""The torch trainer on a tiny Qwen2-VL: rows with images rebuild their pixel inputs from the record."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import torch
from loongsage_plugin_torch.modeling import TINY_QWEN2_VL
from PIL import Image

from loongsage_core.algorithms import compute_norm
from loongsage_core.config import AlgorithmConfig, JobConfig, ModelConfig, TrainConfig
from loongsage_core.plugins import PluginHost
from loongsage_hookspecs import AggregationSpec, Batch, PolicyLossOutput, PolicyLossSpec, TrainWorkerContext

VLM_DIR = str(Path(__file__).resolve().parents[3] / "tests" / "data" / "vlm")
IMAGE = TINY_QWEN2_VL["image_token_id"]


def ratio_pg(x):
    return PolicyLossOutput(loss=-x.advantages * torch.exp(x.logprobs - x.old_logprobs))


def token_mean(loss, mask, norm):
    return (loss * mask).sum() / norm.num_tokens


def make_job() -> JobConfig:
    return JobConfig(model=ModelConfig(config=dict(TINY_QWEN2_VL), tokenizer=VLM_DIR),
                     train=TrainConfig(lr=1e-2, micro_batch_size=2),
                     algorithm=AlgorithmConfig(policy_loss="ratio_pg", loss_agg="token_mean"))


def components() -> PluginHost:
    """The real registry (the torch plugin) with this file's loss and aggregation."""
    host = PluginHost.create(enable=["torch"])
    host.register_specs(PolicyLossSpec(name="ratio_pg", fn=ratio_pg), AggregationSpec(name="token_mean", fn=token_mean))
    return host


def png_b64(colour: str, size: tuple[int, int]) -> str:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


def image_batch() -> Batch:
    """Three rows: one image (15 tokens), two images (15 + 20 tokens), no image; right-padded."""
    rows = [[1, 20, 512] + [IMAGE] * 15 + [513, 30, 31, 32, 33],
            [1, 512] + [IMAGE] * 15 + [513, 40, 512] + [IMAGE] * 20 + [513, 41, 42, 43],
            [1, 50, 51, 52, 53, 54, 55]]
    images = [[png_b64("red", (40, 24))], [png_b64("blue", (40, 24)), png_b64("green", (40, 32))], None]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        attention[i, :len(row)] = 1
        loss_mask[i, len(row) - 3:len(row)] = 1  # the last three tokens are the answer
    return Batch(tensors={"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask,
                          "advantages": loss_mask * 1.0},
                 meta={"sample_id": ["a", "b", "c"], "images": images})


def reference(model, batch: Batch) -> torch.Tensor:
    """transformers' log-probs of each row on its own, pixels from the same image processor."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(VLM_DIR)
    out = torch.zeros(batch["input_ids"].shape)
    for i, images in enumerate(batch.meta["images"]):
        n = int(batch["attention_mask"][i].sum())
        ids = batch["input_ids"][i:i + 1, :n]
        extra = {}
        if images:
            pictures = [Image.open(io.BytesIO(base64.b64decode(b))).convert("RGB") for b in images]
            px = processor(images=pictures, return_tensors="pt")
            extra = {"pixel_values": px["pixel_values"], "image_grid_thw": px["image_grid_thw"],
                     "mm_token_type_ids": (ids == IMAGE).int()}
        with torch.no_grad():
            logits = model(input_ids=ids, **extra).logits[0, :-1].float()
        out[i, 1:n] = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return out


def test_trainer_logprobs_with_images_match_transformers_and_training_moves_the_vision_encoder():
    from loongsage_plugin_torch.trainer import create_train_worker

    worker = create_train_worker(TrainWorkerContext(job=make_job(), components=components()))
    batch = image_batch()
    got = worker.forward(batch)["logprobs"]
    want = reference(worker.model, batch)
    scored = batch["loss_mask"] > 0
    torch.testing.assert_close(got[scored], want[scored], rtol=0, atol=1e-5)
    # the images matter: the same rows without them score differently
    blind = Batch(tensors=dict(batch.tensors), meta={**batch.meta, "images": [None, None, None]})
    assert (worker.forward(blind)["logprobs"][:2][scored[:2]] - got[:2][scored[:2]]).abs().max() > 1e-3

    before = {n: p.detach().clone() for n, p in worker.model.named_parameters() if "visual" in n}
    batch.tensors["old_logprobs"] = got.detach() * batch["loss_mask"]
    batch.tensors["rollout_logprobs"] = batch["old_logprobs"].clone()
    worker.train_mini_batch(batch, compute_norm(batch))
    moved = [n for n, p in worker.model.named_parameters() if "visual" in n and not torch.equal(p, before[n])]
    assert moved  # the loss reached the vision encoder through the image tokens
