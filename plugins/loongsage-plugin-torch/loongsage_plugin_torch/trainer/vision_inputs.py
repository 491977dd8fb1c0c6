"""The vision inputs of a training forward, rebuilt from the rollout record's images.

A batch row built from a segment with images carries, in ``Batch.meta["images"]``, the base64
bytes of the segment's images in token order (the host's batching takes them from
``Trajectory.images`` and ``Segment.images``). :class:`VisionBatchInputs` decodes them and runs
the model's image processor (the same one, saved next to the tokenizer, that the rollout engine
used), so the decoder gets the pixel values, image grids and image-token types that reproduce what
the engine saw: the vision embeddings replace the image tokens' embeddings, and the multimodal
rotary positions come from the model's own rule. Rows with images take the padded forward path
(packing restarts positions per sequence, which the 3-D positions do not allow).
"""

from __future__ import annotations

import base64
import io
from typing import Any, Sequence

import torch


class VisionBatchInputs:
    """Builds the decoder's image keyword arguments for micro-batches of a vision-language policy."""

    def __init__(self, model: Any, processor: Any) -> None:
        self.processor = processor
        self.image_token_id = int(model.config.image_token_id)

    @classmethod
    def for_model(cls, model: Any, tokenizer_dir: str | None) -> "VisionBatchInputs | None":
        """For a vision-language ``model`` (its config has ``vision_config``), its image processor
        from ``tokenizer_dir``; ``None`` for a text model."""
        if getattr(model.config, "vision_config", None) is None:
            return None
        from pathlib import Path

        if not tokenizer_dir or not (Path(tokenizer_dir) / "preprocessor_config.json").is_file():
            raise ValueError(f"torch train backend: the vision-language model needs its image processor "
                             f"(preprocessor_config.json) next to the tokenizer, found none in {tokenizer_dir!r}")
        from transformers import AutoImageProcessor

        return cls(model, AutoImageProcessor.from_pretrained(tokenizer_dir))

    def kwargs(self, input_ids: torch.Tensor, attention: torch.Tensor,
               images: Sequence[Sequence[str] | None]) -> dict[str, torch.Tensor]:
        """``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids`` for rows ``input_ids``
        whose images (base64, token order) are ``images`` (``{}`` when no row has one)."""
        from PIL import Image

        pictures = [Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")
                    for row in images for b64 in (row or ())]
        if not pictures:
            return {}
        processed = self.processor(images=pictures, return_tensors="pt")
        token_types = ((input_ids == self.image_token_id) & (attention > 0)).int()
        return {"pixel_values": processed["pixel_values"].to(input_ids.device),
                "image_grid_thw": processed["image_grid_thw"].to(input_ids.device),
                "mm_token_type_ids": token_types}
