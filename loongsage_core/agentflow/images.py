"""Images in agent conversations: decoding, limits, content hashes and placeholder tokens.

Every protocol adapter hands the router images as chat-completions ``image_url`` parts with a
``data:`` URL (base64 bytes); remote ``http(s)`` URLs are refused (the router never fetches).
:class:`ImageInputs` decodes each image with Pillow, enforces the ``[agentflow]`` limits (bytes
per image, pixels per image, images per request), keeps its bytes once per trajectory under
their sha256 and turns the part into ``{"type": "image", "sha256": ..., "placeholder": ...}``:
the placeholder is the model's vision tokens (``<|vision_start|>``, the image token once per
vision embedding the image processor will produce, ``<|vision_end|>``), so the chat template,
the token-in/token-out delta and the segment record handle an image as ordinary text whose
token count is exactly what the model's vision encoder fills. Two different images of the same
size render the same tokens, so conversations are compared by the image hashes as well
(:func:`~.messages.message_key`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from typing import Any, Mapping, MutableMapping, Sequence

import attrs

from .errors import bad_request

IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
"""Image formats the router decodes (what Pillow reads from the header, not the URL's MIME type)."""

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
"""The Qwen2-VL vision tokens: start, the image placeholder (repeated), end."""


@attrs.define(frozen=True)
class ImageLimits:
    """Per-request image limits (``[agentflow] max_image_bytes``, ``max_image_pixels``,
    ``max_images_per_request``)."""

    max_bytes: int = 10 * 1024 * 1024
    max_pixels: int = 4096 * 4096
    max_images: int = 16


def image_processor_for(tokenizer_dir: str | None) -> Any:
    """The transformers image processor saved next to a tokenizer (``preprocessor_config.json``),
    or ``None`` when there is none (a text-only model)."""
    from pathlib import Path

    if not tokenizer_dir or not (Path(tokenizer_dir) / "preprocessor_config.json").is_file():
        return None
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(tokenizer_dir)


def decode_image(data: bytes, limits: ImageLimits, param: str) -> Any:
    """A Pillow image of ``data`` (fully decoded, RGB), or a 400 naming ``param``: not an image, a
    format outside :data:`IMAGE_FORMATS`, or more pixels than ``limits.max_pixels`` (checked
    from the header before the pixels are decoded)."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise bad_request(f"{param}: the image has {len(data)} bytes, more than the {limits.max_bytes} allowed "
                          "([agentflow] max_image_bytes)", param=param, code="image_too_large")
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise bad_request(f"{param}: the data is not an image Pillow can read ({exc})", param=param,
                          code="invalid_image") from None
    if image.format not in IMAGE_FORMATS:
        raise bad_request(f"{param}: image format {image.format} is not supported (supported: "
                          f"{', '.join(IMAGE_FORMATS)})", param=param, code="unsupported_image_format")
    width, height = image.size
    if width * height > limits.max_pixels:
        raise bad_request(f"{param}: the image has {width}x{height} pixels, more than the {limits.max_pixels} "
                          "allowed ([agentflow] max_image_pixels)", param=param, code="image_too_large")
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise bad_request(f"{param}: the image cannot be decoded ({exc})", param=param,
                          code="invalid_image") from None
    return image.convert("RGB")


def data_url_bytes(url: Any, param: str) -> bytes:
    """The bytes of a base64 ``data:`` URL, or a 400 naming ``param``: remote URLs are refused
    (the router never fetches), and anything else that is not base64 data is malformed."""
    if not isinstance(url, str) or not url:
        raise bad_request(f"{param} must be a data URL string", param=param, code="invalid_type")
    if url.startswith(("http://", "https://")):
        raise bad_request(f"{param}: remote image URLs are not fetched; send the image inline as a base64 "
                          "data URL (data:image/png;base64,...)", param=param, code="remote_image_url")
    head, sep, payload = url.partition(",")
    if not head.startswith("data:") or not sep or not head.endswith(";base64"):
        raise bad_request(f"{param} must be a base64 data URL (data:image/png;base64,...)", param=param,
                          code="invalid_image_url")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param}: the data URL's payload is not valid base64", param=param,
                          code="invalid_image_url") from None


def image_url_of(part: Mapping[str, Any], param: str) -> str:
    """The URL of a chat-completions ``image_url`` part (``{"image_url": {"url": ...}}`` or the
    bare string form), or a 400 naming ``param``."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, Mapping) else value
    if not isinstance(url, str):
        raise bad_request(f"{param}.image_url.url must be a string", param=f"{param}.image_url.url",
                          code="invalid_type")
    return url


class ImageInputs:
    """The router's image handling for a vision-language model (see the module docstring).

    ``processor`` is the model's transformers image processor (it says how many vision tokens an
    image of a given size becomes); ``tokenizer`` must have the :data:`VISION_TOKENS`.
    """

    def __init__(self, processor: Any, tokenizer: Any, limits: ImageLimits | None = None) -> None:
        vocab = tokenizer.get_vocab()
        missing = [t for t in VISION_TOKENS if t not in vocab]
        if missing:
            raise ValueError(f"the tokenizer has an image processor but lacks the vision tokens {missing}")
        self.processor = processor
        self.limits = limits or ImageLimits()
        self.image_token_id = int(vocab[VISION_TOKENS[1]])
        self.merge = int(getattr(processor, "merge_size", 1) or 1)

    def token_count(self, image: Any) -> int:
        """How many image tokens the model's vision encoder produces for ``image``."""
        patches = self.processor.get_number_of_image_patches(image.height, image.width, {})
        return int(patches) // (self.merge * self.merge)

    def placeholder(self, count: int) -> str:
        """The text that stands for an image of ``count`` vision tokens."""
        start, pad, end = VISION_TOKENS
        return start + pad * count + end

    def resolve(self, messages: Sequence[MutableMapping[str, Any]], store: MutableMapping[str, str]) -> int:
        """Replace every ``image_url`` part of ``messages`` (in place) by an ``image`` part with its
        sha256 and placeholder, keeping the bytes in ``store`` (sha256 -> base64) once each;
        returns the number of images. 400s: too many images, a remote or malformed URL, an
        image that does not decode, is too large or of an unsupported format."""
        count = 0
        for i, msg in enumerate(messages):
            content = msg.get("content")
            if not isinstance(content, list):
                continue
            for j, part in enumerate(content):
                if part.get("type") != "image_url":
                    continue
                param = f"messages[{i}].content[{j}]"
                count += 1
                if count > self.limits.max_images:
                    raise bad_request(f"{param}: more than {self.limits.max_images} images in one request "
                                      "([agentflow] max_images_per_request)", param=param, code="too_many_images")
                data = data_url_bytes(image_url_of(part, param), f"{param}.image_url.url")
                image = decode_image(data, self.limits, f"{param}.image_url.url")
                digest = hashlib.sha256(data).hexdigest()
                store.setdefault(digest, base64.b64encode(data).decode("ascii"))
                placeholder = self.placeholder(self.token_count(image))
                content[j] = {"type": "image", "sha256": digest, "placeholder": placeholder}
        return count


def refuse_images(messages: Sequence[Mapping[str, Any]]) -> None:
    """A 400 for the first ``image_url`` part of ``messages``: the router's model takes no images."""
    for i, msg in enumerate(messages):
        content = msg.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if part.get("type") == "image_url":
                param = f"messages[{i}].content[{j}]"
                raise bad_request(f"{param}: this model takes no images (its tokenizer directory has no image "
                                  "processor, preprocessor_config.json)", param=param, code="unsupported_content")


def images_in_order(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The sha256 of every ``image`` part of ``messages``, in the order the template renders them."""
    out: list[str] = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            out += [part["sha256"] for part in content if part.get("type") == "image"]
    return out


def image_spans(tokens: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """``(start, length)`` of every run of ``image_token_id`` in ``tokens``."""
    spans: list[tuple[int, int]] = []
    i, n = 0, len(tokens)
    while i < n:
        if tokens[i] == image_token_id:
            j = i
            while j < n and tokens[j] == image_token_id:
                j += 1
            spans.append((i, j - i))
            i = j
        else:
            i += 1
    return spans
