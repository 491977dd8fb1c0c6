"""Tools that answer with an image, for vision-language policies: ``crop`` zooms into the picture
of the conversation.

Give them to the ``tool_agent`` by import path::

    agent_args = { tools = ["loongsage_plugin_agents.image_tools:crop"] }

The tool's image reaches the model as an image part of its tool message (the router turns it into
the model's vision tokens and records it with the trajectory, so training sees the same pixels).
Which picture: the last image of the trajectory's prompt (an ``image_url`` data URL in a user
message, as the prompts of an image data source carry). A box is given by two opposite corners on
the 0-1000 grid of the picture's width and height and covers at least one pixel (a flat box, the
row or column of pixels it touches); mistakes (no picture, a corner off the grid) come back as text
the model reads, never as exceptions: they are part of the episode.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Annotated, Any

ZOOM = 2
"""How much ``crop`` enlarges the box (nearest neighbour: the pixels stay crisp)."""


def prompt_image(ctx: Any) -> Any:
    """The last image of the trajectory's prompt as a Pillow image (RGB), or ``None``."""
    from PIL import Image

    messages = ctx.prompt if isinstance(ctx.prompt, list) else []
    urls = [part["image_url"]["url"] for message in messages if isinstance(message, dict)
            and isinstance(message.get("content"), list) for part in message["content"]
            if isinstance(part, dict) and part.get("type") == "image_url"]
    for url in reversed(urls):
        head, _, data = str(url).partition(",")
        if not head.startswith("data:") or not head.endswith(";base64"):
            continue
        try:
            return Image.open(io.BytesIO(base64.b64decode(data, validate=True))).convert("RGB")
        except (binascii.Error, OSError):
            continue
    return None


GRID = 1000
"""``crop``'s coordinates are thousandths of the picture's width and height (the normalised grid
vision-language models ground boxes on), so a box means the same at every resolution."""

Coordinate = Annotated[int, {"minimum": 0, "maximum": GRID}]


def crop(x0: Coordinate, y0: Coordinate, x1: Coordinate, y1: Coordinate, ctx: Any = None) -> Any:
    """Crop the picture to the box between two opposite corners and show it enlarged.
    Coordinates are in thousandths of the picture's width (x) and height (y).

    Args:
        x0: one corner's x (0 is the picture's left edge, 1000 its right edge).
        y0: that corner's y (0 is the picture's top edge, 1000 its bottom edge).
        x1: the opposite corner's x.
        y1: the opposite corner's y.
    """
    image = prompt_image(ctx) if ctx is not None else None
    if image is None:
        return "Error: there is no picture in the conversation to crop"
    width, height = image.size
    given = (x0, y0, x1, y1)
    if not all(isinstance(v, int) and 0 <= v <= GRID for v in given):
        return f"Error: the corners {given} must be integers from 0 to {GRID} (thousandths of the picture's size)"
    left, right, top, bottom = min(x0, x1), max(x0, x1), min(y0, y1), max(y0, y1)
    px, py = min(left * width // GRID, width - 1), min(top * height // GRID, height - 1)
    box = (px, py, max(px + 1, -(-right * width // GRID)), max(py + 1, -(-bottom * height // GRID)))
    from PIL import Image

    part = image.crop(box)
    zoomed = part.resize((part.width * ZOOM, part.height * ZOOM), Image.Resampling.NEAREST)
    return [f"The box between ({x0}, {y0}) and ({x1}, {y1}) (pixels {box}) of the {width}x{height} picture, "
            f"{ZOOM}x larger:", zoomed]
