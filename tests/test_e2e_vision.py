"""End to end with a vision-language policy: prompts with images go controller -> AgentFlow router
(an image part of a chat request) -> embedded engine (vision encoder, multimodal rotary positions)
-> token-exact record with the images -> trainer loss on the same pixels.

The policy is a tiny Qwen2-VL built from ``TINY_QWEN2_VL`` with the tokenizer and image processor
of tests/data/vlm. The trainer's old log-probs are recomputed from the record (tokens plus the
images rebuilt from their bytes) and compared with the engine's: their k3 gap is as small as on a
text model, which it could not be if either side saw other pixels or other positions.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import tomli_w
from loongsage_plugin_torch.modeling import TINY_QWEN2_VL
from PIL import Image, ImageDraw

from loongsage_core.config import load_job
from loongsage_core.controller.run import SyncLoop
from loongsage_core.controller.runtime import Run
from loongsage_core.records import read_rollouts, rollout_steps
from loongsage_core.resolve import resolve_job

VLM_DIR = Path(__file__).resolve().parent / "data" / "vlm"
IMAGE_TOKEN = TINY_QWEN2_VL["image_token_id"]


def shapes_png(count: int, colour: str, size: tuple[int, int]) -> bytes:
    """A PNG with ``count`` filled squares of ``colour`` on white."""
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    for i in range(count):
        draw.rectangle((2 + 9 * i, 4, 8 + 9 * i, 10), fill=colour)
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def write_rows(path: Path) -> None:
    rows = []
    for i, (count, colour) in enumerate([(1, "red"), (2, "blue"), (3, "green"), (2, "red")]):
        url = "data:image/png;base64," + base64.b64encode(shapes_png(count, colour, (32 + 8 * i, 24))).decode()
        rows.append({"prompt": [{"role": "user", "content": [
            {"type": "text", "text": "How many squares? "}, {"type": "image_url", "image_url": {"url": url}}]}],
            "label": str(count)})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def vision_run(tmp_path: Path, *, steps: int, seed: int, max_new_tokens: int, context: int,
               source: dict, **tables: dict) -> Run:
    """The run of a job training the tiny Qwen2-VL on :func:`write_rows`' pictures, with ``source``
    as its one ``[[data]]`` table (its ``path`` added) and ``tables`` added to the job."""
    write_rows(tmp_path / "shapes.jsonl")
    job = {
        "plugins": {"enable": ["torch", "rl", "rewards", "loggers", "agents"]},
        "model": {"tokenizer": str(VLM_DIR), "config": TINY_QWEN2_VL},
        "train": {"lr": 1e-3, "total_steps": steps, "mini_batch_size": 4, "micro_batch_size": 2},
        "rollout": {"prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": max_new_tokens,
                    "max_context_length": context, "temperature": 1.0},
        "placement": {"colocate": False},
        "run": {"seed": seed, "checkpoint_every": 0, "save_hf_at_end": False},
        "data": [{**source, "path": str(tmp_path / "shapes.jsonl"), "reward": ["exact_match"]}],
        **tables,
    }
    (tmp_path / "job.toml").write_text(tomli_w.dumps(job))
    return Run(resolve_job(load_job(tmp_path / "job.toml")), tmp_path / "run")


def test_a_vision_language_policy_trains_on_image_conversations(ray_cluster, tmp_path):
    controller = vision_run(tmp_path, steps=2, seed=3, max_new_tokens=5, context=256, source={"name": "shapes"})
    loop = SyncLoop(controller)
    try:
        controller.start()
        for step in range(2):
            metrics = loop.run_step(step)
            controller.step = step + 1
            assert metrics["rollout/num_rows"] == 4.0
            # the trainer's forward on the rebuilt pixels matches the engine's sampling distribution
            assert metrics["train/is_approx_k3_kl"] < 1e-6
    finally:
        controller.close()
    records = [rec for step in rollout_steps(tmp_path / "run") for rec in read_rollouts(tmp_path / "run", step)]
    assert len(records) == 8
    for rec in records:
        (seg,) = rec["segments"]
        (image,) = seg["images"]
        span = range(image["start"], image["start"] + image["length"])
        # the image's placeholder tokens, with loss mask 0, and its bytes stored once with the trajectory
        assert [seg["tokens"][i] for i in span] == [IMAGE_TOKEN] * image["length"]
        assert all(seg["loss_mask"][i] == 0 for i in span)
        assert IMAGE_TOKEN not in seg["tokens"][:image["start"]] + seg["tokens"][span.stop:]
        png = base64.b64decode(rec["images"][image["sha256"]])
        assert Image.open(io.BytesIO(png)).size[1] == 24
        assert sum(seg["loss_mask"]) > 0
        # the conversation refers to the image by hash: its bytes are in the record once
        parts = [p for m in rec["messages"] if isinstance(m["content"], list) for p in m["content"]]
        assert {"type": "image", "sha256": image["sha256"]} in parts
        assert not any(p.get("type") == "image_url" for p in parts)
    shows_images_inline(tmp_path / "run", records[0])


def shows_images_inline(run: Path, record: dict) -> None:
    """``loongsage view``'s trajectory page draws the conversation's image (a real headless browser)."""
    import shutil

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    from loongsage_core.viewer import ViewerServer

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-proxy-server"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=shutil.which("chromedriver")), options=options)
    server = ViewerServer([str(run)])
    try:
        driver.get(server.start() + f"#/traj/0/{record['step']}/{record['index']}")
        size = WebDriverWait(driver, 30, poll_frequency=0.2).until(lambda d: d.execute_script(
            "const i = document.querySelector('#traj-messages img');"
            "return i && i.complete && i.naturalWidth ? [i.naturalWidth, i.naturalHeight] : null"))
        (sha,) = [p["sha256"] for m in record["messages"] if isinstance(m["content"], list) for p in m["content"]
                  if p.get("type") == "image"]
        assert size == list(Image.open(io.BytesIO(base64.b64decode(record["images"][sha]))).size)
    finally:
        driver.quit()
        server.stop()


def test_a_tool_that_answers_with_an_image_trains_end_to_end(ray_cluster, tmp_path):
    """The ``tool_agent`` with the ``crop`` tool, its call forced (``tool_choice`` naming ``crop``:
    constrained decoding in the model's own hermes syntax), two turns: the tool's zoomed picture
    goes back to the policy as an image part of the tool message, the router records it beside the
    prompt's picture, and the trainer scores the whole conversation on the rebuilt pixels."""
    agent_args = {"tools": ["loongsage_plugin_agents.image_tools:crop"], "max_turns": 2,
                  "request_args": {"tool_choice": {"type": "function", "function": {"name": "crop"}},
                                   "max_tokens": 120}}
    controller = vision_run(tmp_path, steps=1, seed=5, max_new_tokens=400, context=1024,
                            source={"name": "zoom", "agent": "tool_agent", "agent_args": agent_args},
                            agentflow={"middleware": ["tool_call_parser"],
                                       "middleware_args": {"tool_call_parser": {"format": "hermes"}}})
    try:
        controller.start()
        metrics = SyncLoop(controller).run_step(0)
        assert metrics["rollout/num_rows"] == 4.0 and metrics["rollout/failed_ratio"] == 0.0
        assert metrics["train/is_approx_k3_kl"] < 1e-6
    finally:
        controller.close()
    records = [rec for step in rollout_steps(tmp_path / "run") for rec in read_rollouts(tmp_path / "run", step)]
    zoomed = 0
    for rec in records:
        tool_images = [p["sha256"] for m in rec["messages"] if m["role"] == "tool" and isinstance(m["content"], list)
                       for p in m["content"] if p.get("type") == "image"]
        recorded = {img["sha256"] for seg in rec["segments"] for img in seg["images"]}
        assert set(tool_images) <= recorded and set(tool_images) <= set(rec["images"])
        for sha in tool_images:  # the crop, twice as large as its box: a picture of its own
            size = Image.open(io.BytesIO(base64.b64decode(rec["images"][sha]))).size
            assert size[0] % 2 == 0 and size[1] % 2 == 0
        zoomed += len(tool_images)
    assert zoomed > 0, [m for rec in records for m in rec["messages"] if m["role"] == "tool"]
