"""The sampling engine pool on real embedded engines: weights of the same architecture are loaded
into an idle engine, and an engine whose reload fails is stopped, never kept under either name."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

PARAMS = {"max_tokens": 4, "temperature": 1.0, "seed": 5, "stop": []}


def _copy_with(src: Path, dst: Path, scale: float, extra: bool = False) -> Path:
    """``src``'s model directory at ``dst``, every weight times ``scale``; with ``extra``, its file
    also holds a tensor the model has no parameter for (a plain load ignores it; a reload into a
    running engine refuses it before copying anything)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = {name: t * scale for name, t in load_file(str(src / "model.safetensors")).items()}
    if extra:
        tensors["model.extra_head.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _other_architecture(src: Path, dst: Path) -> Path:
    """A model of another shape (a wider MLP) with ``src``'s tokenizer."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(src))
    config.intermediate_size *= 2
    torch.manual_seed(1)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(dst)
    transformers.AutoTokenizer.from_pretrained(str(src)).save_pretrained(dst)
    return dst


@pytest.fixture
def pool(slow_fixture: Any, tiny_model_dir: Path) -> Any:
    from loongsage_plugin_tinker.cli import DEFAULT_JOB
    from loongsage_plugin_tinker.sampling import EnginePool

    from loongsage_core.cli import load_job_and_host

    job, host = load_job_and_host(str(DEFAULT_JOB))
    return EnginePool(job, host, max_engines=2)  # closed by the test, in the event loop it ran in


def test_a_failed_reload_stops_the_engine_and_starts_a_fresh_one(pool: Any, tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    """Two engines may run: one of another architecture, one of the tiny model. Weights of the
    tiny model's shape are reloaded into its engine (no new engine). A directory that engine
    refuses (an unknown tensor) stops it, and its server answers no more; the other engine, older
    but not the one at fault, keeps running; a fresh engine on the directory samples from it."""
    scaled = _copy_with(tiny_model_dir, tmp_path / "scaled", 0.5)
    refused = _copy_with(tiny_model_dir, tmp_path / "refused", 2.0, extra=True)
    other = str(_other_architecture(tiny_model_dir, tmp_path / "other"))
    prompt = [1, 2, 3, 4]

    async def scenario() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        try:
            await pool.sample(other, prompt, 1, PARAMS)
            seen["first"] = (await pool.sample(str(tiny_model_dir), prompt, 1, PARAMS)).sequences[0].logprobs
            seen["reloaded"] = (await pool.sample(str(scaled), prompt, 1, PARAMS)).sequences[0].logprobs
            seen["after_reload"] = (pool.started, pool.reloaded, pool.running)
            old_url = pool._engines[str(scaled)].client.base_url
            seen["fresh"] = (await pool.sample(str(refused), prompt, 1, PARAMS)).sequences[0].logprobs
            seen["after_refusal"] = (pool.started, pool.reloaded, pool.running)
            new_url = pool._engines[str(refused)].client.base_url
            async with httpx.AsyncClient(timeout=5) as http:
                seen["new_answers"] = (await http.get(f"{new_url}/health")).status_code
                try:
                    seen["old_answers"] = (await http.get(f"{old_url}/health")).status_code
                except httpx.TransportError:
                    seen["old_answers"] = None
        finally:
            await pool.close()
        return seen

    seen = asyncio.run(scenario())
    assert seen["after_reload"] == (2, 1, [other, str(scaled)])  # loaded into the running engine
    assert seen["reloaded"] != seen["first"]  # which samples the new weights
    assert seen["after_refusal"] == (3, 1, [other, str(refused)])  # the refused reload did not count; a new engine did
    assert seen["fresh"] != seen["reloaded"] and len(seen["fresh"]) == 4
    assert seen["new_answers"] == 200
    assert seen["old_answers"] is None  # the engine that refused the weights was stopped
