"""Images in agent conversations: the three protocols through the real router in front of a real
embedded engine running a tiny vision-language model (Qwen2-VL family), the token-exact record
of the images, the engine's log-probs against transformers, and the 400s for bad images.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest
import torch
from PIL import Image

from loongsage_core.agentflow.record import TrajectoryRecord

VLM_DIR = Path(__file__).resolve().parents[1] / "data" / "vlm"
IMAGE_TOKEN = 514


def png(colour: str = "red", size: tuple[int, int] = (40, 24), fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def vlm_job() -> Any:
    from loongsage_plugin_torch.modeling import TINY_QWEN2_VL

    from loongsage_core.config import structure_job

    return structure_job({"model": {"config": TINY_QWEN2_VL, "tokenizer": str(VLM_DIR)},
                          "rollout": {"max_context_length": 512}, "run": {"seed": 0}})


@pytest.fixture(scope="module")
def vlm_engine(slow_fixture) -> Iterator[Any]:
    """A real embedded engine serving a randomly initialised tiny Qwen2-VL."""
    from loongsage_plugin_torch.engine.engine import EmbeddedEngine

    from loongsage_hookspecs import EngineContext

    engine = EmbeddedEngine(EngineContext(job=vlm_job(), components=None))
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.fixture
def vlm_router(vlm_engine) -> Iterator[Any]:
    """A started router for the tiny VLM (its tokenizer and image processor), small image limits."""
    from transformers import AutoTokenizer

    from loongsage_core.agentflow import AgentFlowRouter
    from loongsage_core.agentflow.images import ImageLimits, image_processor_for

    router = AgentFlowRouter(AutoTokenizer.from_pretrained(str(VLM_DIR)), [vlm_engine.base_url],
                             image_processor=image_processor_for(str(VLM_DIR)),
                             image_limits=ImageLimits(max_bytes=200_000, max_pixels=100 * 100, max_images=2))
    router.start()
    try:
        yield router
    finally:
        router.shutdown()


def reference_logprobs(model: Any, ids: list[int], images: list[bytes], generated: list[int]) -> torch.Tensor:
    """transformers' log-probs of ``generated`` after ``ids`` with ``images`` (one plain forward)."""
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(str(VLM_DIR))
    pixels = processor(images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt")
    full = torch.tensor([ids + generated])
    with torch.no_grad():
        logits = model(input_ids=full, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                       mm_token_type_ids=(full == IMAGE_TOKEN).int()).logits[0].float()
    return torch.log_softmax(logits, -1)[len(ids) - 1:-1].gather(-1, torch.tensor(generated)[:, None])[:, 0]


def generate(url: str, ids: list[int], images: list[bytes], **sampling: Any) -> dict[str, Any]:
    body = {"input_ids": ids, "image_data": [base64.b64encode(b).decode() for b in images], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3, **sampling}}
    resp = httpx.post(url + "/generate", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_engine_logprobs_match_transformers_with_images_also_after_a_weight_update(vlm_engine):
    ids = [1, 20, 30, 512] + [IMAGE_TOKEN] * 15 + [513, 40, 512] + [IMAGE_TOKEN] * 20 + [513, 50]
    images = [png("red", (40, 24)), png("blue", (40, 32))]
    for version in (0, 1):
        out = generate(vlm_engine.base_url, ids, images)
        lps = torch.tensor([t[0] for t in out["meta_info"]["output_token_logprobs"]])
        ref = reference_logprobs(vlm_engine.model, ids, images, out["output_ids"])
        assert (lps - ref).abs().max() < 1e-5
        if version == 0:  # new weights for the text model and the vision encoder alike
            gen = torch.Generator().manual_seed(5)
            updated = [(name, torch.randn(t.shape, generator=gen) * 0.05)
                       for name, t in vlm_engine.model.named_parameters() if "layers.0." in name or "blocks.0" in name]
            assert any("visual" in name for name, _ in updated)
            vlm_engine.load_weights(updated, 1)


def test_engine_prefix_cache_tells_images_apart_and_serves_the_next_turn(vlm_engine):
    ids = [1, 21, 512] + [IMAGE_TOKEN] * 15 + [513, 41]
    red = generate(vlm_engine.base_url, ids, [png("red")], temperature=0)
    blue = generate(vlm_engine.base_url, ids, [png("blue")], temperature=0)
    again = generate(vlm_engine.base_url, ids, [png("red")], temperature=0)
    assert blue["meta_info"]["cached_tokens"] == 0  # same tokens, another image: no reuse
    assert again["meta_info"]["cached_tokens"] == len(ids) - 1
    first = [out["meta_info"]["output_token_logprobs"][0][0] for out in (red, blue, again)]
    assert first[2] == pytest.approx(first[0], abs=1e-6) and abs(first[1] - first[0]) > 1e-4
    # the next turn (the answer, more text, a second image) reuses the first turn's KV, image included
    turn2 = ids + red["output_ids"] + [42, 512] + [IMAGE_TOKEN] * 15 + [513, 43]
    out = generate(vlm_engine.base_url, turn2, [png("red"), png("blue")], temperature=0)
    assert out["meta_info"]["cached_tokens"] >= len(ids)
    ref = reference_logprobs(vlm_engine.model, turn2, [png("red"), png("blue")], out["output_ids"])
    assert (torch.tensor([t[0] for t in out["meta_info"]["output_token_logprobs"]]) - ref).abs().max() < 1e-5
    # the same tokens with the images swapped: whatever KV it reuses (the blue request's), its
    # log-probs are those of its own images
    swapped = generate(vlm_engine.base_url, turn2, [png("blue"), png("red")], temperature=0)
    assert swapped["meta_info"]["cached_tokens"] <= len(ids) + len(red["output_ids"])  # not the red-first turn's
    ref = reference_logprobs(vlm_engine.model, turn2, [png("blue"), png("red")], swapped["output_ids"])
    assert (torch.tensor([t[0] for t in swapped["meta_info"]["output_token_logprobs"]]) - ref).abs().max() < 1e-5


def test_engine_refuses_images_that_do_not_fit_the_prompt(vlm_engine):
    resp = httpx.post(vlm_engine.base_url + "/generate", json={
        "input_ids": [1, 512, IMAGE_TOKEN, 513], "image_data": [base64.b64encode(png()).decode()]}, timeout=30)
    assert resp.status_code == 400 and "15" in resp.json()["error"]["message"]


def image_spans(record: TrajectoryRecord) -> list[tuple[str, int, int]]:
    (seg,) = record.segments
    for image in seg.images:
        span = seg.tokens[image.start:image.start + image.length]
        assert span == [IMAGE_TOKEN] * image.length
        assert not any(seg.loss_mask[image.start:image.start + image.length])
        assert image.sha256 in record.images
    assert seg.tokens.count(IMAGE_TOKEN) == sum(i.length for i in seg.images)
    return [(i.sha256, i.start, i.length) for i in seg.images]


def test_chat_completions_with_images_record_them_token_exactly(vlm_router):
    url = vlm_router.blocking.register("img-chat", sampling={"max_new_tokens": 4})
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    first = [{"role": "user", "content": [{"type": "text", "text": "What is this? "},
                                          {"type": "image_url", "image_url": {"url": data_url(png("red"))}}]}]
    answer = client.chat.completions.create(model="p", messages=first)
    follow = first + [{"role": "assistant", "content": answer.choices[0].message.content},
                      {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png("blue"))}},
                                                   {"type": "text", "text": "And this?"}]}]
    streamed = client.chat.completions.create(model="p", messages=follow, stream=True)  # the streaming path too
    assert [chunk for chunk in streamed]
    record = vlm_router.blocking.get("img-chat")
    assert len(record.segments) == 1  # the second turn extends the first: one token-exact segment
    spans = image_spans(record)
    assert len(spans) == 2 and spans[0][0] != spans[1][0] and spans[0][2] == spans[1][2] == 15
    assert sorted(record.images) == sorted(s for s, _, _ in spans)
    assert base64.b64decode(record.images[spans[1][0]]) == png("blue")
    # the record survives the admin API's wire format
    again = TrajectoryRecord.from_dict(record.to_dict())
    assert again.segments[0].images == record.segments[0].images and again.images == record.images


def test_responses_input_image(vlm_router):
    url = vlm_router.blocking.register("img-resp", sampling={"max_new_tokens": 3})
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
    client.responses.create(model="p", input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Describe "}, {"type": "input_image", "image_url": data_url(png("green"))}]}])
    record = vlm_router.blocking.get("img-resp")
    (span,) = image_spans(record)
    assert base64.b64decode(record.images[span[0]]) == png("green")


def test_anthropic_image_block(vlm_router):
    url = vlm_router.blocking.register("img-anth", sampling={"max_new_tokens": 3})
    client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="k", max_retries=0)
    client.messages.create(model="p", max_tokens=3, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                     "data": base64.b64encode(png("red", fmt="JPEG")).decode()}},
        {"type": "text", "text": "Colour?"}]}])
    record = vlm_router.blocking.get("img-anth")
    (span,) = image_spans(record)
    assert base64.b64decode(record.images[span[0]]) == png("red", fmt="JPEG")
    # a tool result with a screenshot: its image is recorded like the user's
    url2 = vlm_router.blocking.register("img-anth-tool", sampling={"max_new_tokens": 3})
    client = anthropic.Anthropic(base_url=url2.removesuffix("/v1"), api_key="k", max_retries=0)
    screenshot = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                              "data": base64.b64encode(png("green")).decode()}}
    client.messages.create(model="p", max_tokens=3, messages=[
        {"role": "user", "content": "Take a screenshot."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "here:"}, screenshot]}]}])
    record = vlm_router.blocking.get("img-anth-tool")
    (span,) = image_spans(record)
    assert base64.b64decode(record.images[span[0]]) == png("green")


def bad_chat(url: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    resp = httpx.post(url + "/chat/completions", json={"model": "p", "messages": [{"role": "user", "content": parts}]},
                      timeout=30)
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


def test_bad_images_are_clear_400s(vlm_router):
    url = vlm_router.blocking.register("img-bad", sampling={"max_new_tokens": 2})
    image = {"type": "image_url", "image_url": {"url": data_url(png())}}
    cases = [
        ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "remote_image_url"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,not base64!"}}, "invalid_image_url"),
        ({"type": "image_url", "image_url": {"url": data_url(b"GIF89a but not really")}}, "invalid_image"),
        ({"type": "image_url", "image_url": {"url": data_url(png(size=(200, 200)))}}, "image_too_large"),
        ({"type": "image_url", "image_url": {"url": data_url(png(fmt="TIFF"), "image/tiff")}},
         "unsupported_image_format"),
        ({"type": "image_url", "image_url": {"url": "/tmp/cat.png"}}, "invalid_image_url"),
    ]
    for part, code in cases:
        err = bad_chat(url, [{"type": "text", "text": "x"}, part])
        assert err["code"] == code and err["param"].startswith("messages[0].content[1]"), err
    err = bad_chat(url, [image, image, image])
    assert err["code"] == "too_many_images" and "max_images_per_request" in err["message"]
    # an Anthropic url source and a Responses file are refused the same way
    resp = httpx.post(url + "/messages", json={"model": "p", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]}, timeout=30)
    assert resp.status_code == 400 and "not fetched" in resp.json()["error"]["message"]
    resp = httpx.post(url + "/responses", json={"model": "p", "input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file_1"}]}]}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "input[0].content[0].file_id"
    assert vlm_router.blocking.get("img-bad").segments == []  # nothing was generated or recorded


def test_a_text_model_refuses_images(engine_url, router_factory):
    router = router_factory([engine_url])
    url = router.blocking.register("img-text", sampling={"max_new_tokens": 2})
    err = bad_chat(url, [{"type": "image_url", "image_url": {"url": data_url(png())}}])
    assert err["code"] == "unsupported_content" and "takes no images" in err["message"]
