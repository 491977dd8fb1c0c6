"""Tools that answer with images: ``crop`` on the prompt's picture, and how a tool's images become
the image parts of its tool message (the tool agent's own conversion, with its text cut)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from types import SimpleNamespace

from loongsage_plugin_agents.image_tools import ZOOM, crop
from loongsage_plugin_agents.python_tools import tool_content
from loongsage_plugin_agents.tool_agent import ToolAgent
from PIL import Image


def _picture() -> Image.Image:
    """A 12x8 picture whose every pixel has its own colour (x, y, 7)."""
    image = Image.new("RGB", (12, 8))
    for x in range(12):
        for y in range(8):
            image.putpixel((x, y), (x * 20, y * 30, 7))
    return image


def _url(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _ctx(*images: Image.Image) -> SimpleNamespace:
    content = [{"type": "text", "text": "Look:"}] + [{"type": "image_url", "image_url": {"url": _url(i)}}
                                                      for i in images]
    return SimpleNamespace(prompt=[{"role": "user", "content": content}], sandbox=None)


def _decode(part: dict) -> Image.Image:
    head, _, data = part["image_url"]["url"].partition(",")
    assert head == "data:image/png;base64"
    return Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")


def test_crop_returns_the_box_of_the_prompts_last_picture_enlarged():
    """Thousandths of the 12x8 picture: corners (250, 125) and (500, 500) are pixels (3, 1) to (6, 4),
    in either order."""
    other, picture = Image.new("RGB", (5, 5), "red"), _picture()
    caption, image = crop(250, 125, 500, 500, ctx=_ctx(other, picture))
    assert "(250, 125) and (500, 500)" in caption and "pixels (3, 1, 6, 4)" in caption and "12x8" in caption
    assert image.size == (3 * ZOOM, 3 * ZOOM)
    for x in range(3 * ZOOM):
        for y in range(3 * ZOOM):
            assert image.getpixel((x, y)) == picture.getpixel((3 + x // ZOOM, 1 + y // ZOOM))
    _, swapped = crop(500, 500, 250, 125, ctx=_ctx(picture))
    assert list(swapped.getdata()) == list(image.getdata())
    _, whole = crop(0, 0, 1000, 1000, ctx=_ctx(picture))
    assert whole.size == (12 * ZOOM, 8 * ZOOM)
    _, dot = crop(1000, 1000, 1000, 1000, ctx=_ctx(picture))  # a flat box covers the pixel it touches
    assert dot.size == (ZOOM, ZOOM) and dot.getpixel((0, 0)) == picture.getpixel((11, 7))


def test_crop_mistakes_come_back_as_text():
    assert crop(0, 0, 2, 2, ctx=SimpleNamespace(prompt="no picture here")).startswith("Error: there is no picture")
    for box in ((0, 0, 1001, 200), (-1, 0, 5, 5), (0.5, 0, 5, 5), ("1", 0, 5, 5)):
        out = crop(*box, ctx=_ctx(_picture()))
        assert isinstance(out, str) and "must be integers from 0 to 1000" in out, box


def test_a_tools_images_become_image_parts_of_its_tool_message():
    picture = _picture()
    parts = tool_content(["caption", picture])
    assert parts[0] == {"type": "text", "text": "caption"} and parts[1]["type"] == "image_url"
    assert list(_decode(parts[1]).getdata()) == list(picture.getdata())
    assert tool_content(picture)[0]["type"] == "image_url"
    assert tool_content(["a", "b"]) == json.dumps(["a", "b"])  # no image: JSON as before

    agent = ToolAgent(tools=["loongsage_plugin_agents.image_tools:crop"], max_tool_output_chars=10)
    arguments = json.dumps({"x0": 0, "y0": 0, "x1": 500, "y1": 500})
    call = SimpleNamespace(function=SimpleNamespace(name="crop", arguments=arguments))
    out = asyncio.run(agent._run_call(call, _ctx(picture)))
    assert out[0]["type"] == "text" and out[0]["text"].startswith("The box be")
    assert "more characters" in out[0]["text"]  # the text part is cut like any tool output
    assert _decode(out[1]).size == (6 * ZOOM, 4 * ZOOM)
    schema = agent.schemas[0]["function"]
    assert schema["name"] == "crop" and set(schema["parameters"]["required"]) == {"x0", "y0", "x1", "y1"}
    # the grid's bounds are in the schema: a forced call (constrained decoding) stays on it
    x0 = schema["parameters"]["properties"]["x0"]
    assert (x0["type"], x0["minimum"], x0["maximum"]) == ("integer", 0, 1000) and "left edge" in x0["description"]
    assert schema["parameters"]["additionalProperties"] is False
    assert "ctx" not in schema["parameters"]["properties"]
