"""Images for a vision-language policy (Qwen2-VL family) in the embedded engine.

A ``/generate`` request carries its images as SGLang's ``image_data`` (base64, or base64 data
URLs), in the order their placeholder tokens appear in ``input_ids`` (the model's image token,
repeated once per vision embedding). :class:`VisionPreprocessor` decodes them with Pillow and
runs the model's image processor on the server thread (a bad image is a 400 before the request
is queued) and computes the request's multimodal rotary positions with the model's own
``get_rope_index``; the vision encoder runs once per request on the loop thread, just before its
prefill (:meth:`VisionInputs.ensure_embeddings`), with the weights the prefill uses. The runner
then puts the vision embeddings in place of the placeholder tokens' embeddings and rotates
queries and keys by the 3-D positions (:meth:`~.runner.ModelRunner.forward`).

The KV of an image token depends on the image, not on the token id, so the prefix cache keys a
request's KV by :attr:`VisionInputs.key_tokens`: the prompt with each image's placeholder tokens
replaced by a negative number drawn from that image's sha256. Two requests share cached KV exactly
as far as their tokens and images agree, so the next turn of a conversation with images reuses the
previous turn's KV, and the same tokens with another image never do.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from typing import TYPE_CHECKING, Any, Sequence

import attrs

from .request_checks import InvalidRequest

if TYPE_CHECKING:  # pragma: no cover
    import torch

VISION_MODEL_TYPES = ("qwen2_vl",)
"""Vision-language families the embedded engine runs (their text model, vision encoder and rotary rule)."""


def is_vision_model(model: Any) -> bool:
    """Whether ``model`` is a vision-language model of :data:`VISION_MODEL_TYPES`."""
    return getattr(model.config, "model_type", None) in VISION_MODEL_TYPES


@attrs.define(eq=False)
class VisionInputs:
    """One request's images as the model sees them.

    ``pixel_values`` / ``grid_thw``: the image processor's output; ``positions`` ``[3, L]``: the
    multimodal rotary positions of the prompt's ``L`` tokens; ``delta``: what a token after the
    prompt adds to its index to get its (1-D) rotary position; ``embed_row`` ``[L]``: for each
    prompt position, the row of the vision embeddings that replaces its token embedding (-1: none);
    ``key_tokens``: the prompt as the prefix cache keys it (see the module docstring).
    """

    pixel_values: Any
    grid_thw: Any
    positions: Any
    delta: int
    embed_row: Any
    key_tokens: list[int]
    embeddings: Any = None

    def ensure_embeddings(self, model: Any) -> None:
        """Run the vision encoder (once): ``embeddings`` ``[image tokens, hidden]``."""
        if self.embeddings is not None:
            return
        import torch

        with torch.inference_mode():
            out = model.model.get_image_features(self.pixel_values, image_grid_thw=self.grid_thw)
            self.embeddings = torch.cat(list(out.pooler_output), 0).to(model.lm_head.weight.dtype)

    def rope_positions(self, pos: "torch.Tensor") -> "torch.Tensor":
        """``[3, n]`` rotary positions of the tokens at indices ``pos`` of this request."""
        import torch

        inside = pos < self.positions.shape[1]
        out = (pos + self.delta).expand(3, -1).clone()
        if bool(inside.any()):
            out[:, inside] = self.positions[:, pos[inside]]
        return torch.as_tensor(out)


def _image_bytes(value: Any, where: str) -> bytes:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"'{where}' must be a base64 string", where)
    if value.startswith(("http://", "https://")):
        raise InvalidRequest(f"'{where}': remote image URLs are not fetched; send base64", where)
    payload = value.partition(",")[2] if value.startswith("data:") else value
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"'{where}' is not valid base64", where) from None


class VisionPreprocessor:
    """Turns a request's ``image_data`` into :class:`VisionInputs` for a vision-language model."""

    def __init__(self, model: Any, processor: Any) -> None:
        self.model = model
        self.processor = processor
        self.image_token_id = int(model.config.image_token_id)

    @classmethod
    def for_model(cls, model: Any, tokenizer_path: str | None) -> "VisionPreprocessor | None":
        """The preprocessor of a vision-language ``model`` (its image processor saved next to the
        tokenizer), ``None`` for a text model; a vision model without one is a ``ValueError``."""
        if not is_vision_model(model):
            return None
        from pathlib import Path

        if not tokenizer_path or not (Path(tokenizer_path) / "preprocessor_config.json").is_file():
            raise ValueError(f"embedded engine: the vision-language model needs its image processor "
                             f"(preprocessor_config.json) next to the tokenizer, found none in {tokenizer_path!r}")
        from transformers import AutoImageProcessor

        return cls(model, AutoImageProcessor.from_pretrained(tokenizer_path))

    def prepare(self, input_ids: Sequence[int], images: Sequence[str], where: str) -> VisionInputs:
        """Decode and preprocess ``images`` for the prompt ``input_ids``; an :class:`InvalidRequest`
        when an image does not decode or the placeholder tokens do not match the images."""
        import torch
        from PIL import Image, UnidentifiedImageError

        pictures, keys = [], []
        for i, value in enumerate(images):
            data = _image_bytes(value, f"{where}[{i}]")
            keys.append(-1 - int(hashlib.sha256(data).hexdigest()[:15], 16))
            try:
                pictures.append(Image.open(io.BytesIO(data)).convert("RGB"))
            except (UnidentifiedImageError, OSError, ValueError) as exc:
                raise InvalidRequest(f"'{where}[{i}]' is not an image: {exc}", f"{where}[{i}]") from None
        processed = self.processor(images=pictures, return_tensors="pt")
        grid = processed["image_grid_thw"]
        merge = int(self.model.config.vision_config.spatial_merge_size)
        expected = int((grid.prod(-1) // (merge * merge)).sum())
        ids = torch.tensor([list(input_ids)])
        is_image = ids == self.image_token_id
        found = int(is_image.sum())
        if found != expected:
            raise InvalidRequest(f"'{where}': the prompt has {found} image tokens, its {len(pictures)} images "
                                 f"need {expected}", where)
        positions, delta = self.model.model.get_rope_index(ids, mm_token_type_ids=is_image.int(), image_grid_thw=grid)
        embed_row = torch.full((ids.shape[1],), -1, dtype=torch.long)
        embed_row[is_image[0]] = torch.arange(found)
        per_image = (grid.prod(-1) // (merge * merge)).tolist()
        image_keys = iter([key for key, count in zip(keys, per_image) for _ in range(count)])
        key_tokens = [next(image_keys) if t == self.image_token_id else int(t) for t in input_ids]
        return VisionInputs(pixel_values=processed["pixel_values"], grid_thw=grid, positions=positions[:, 0],
                            delta=int(delta.reshape(-1)[0]), embed_row=embed_row, key_tokens=key_tokens)
