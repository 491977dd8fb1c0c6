"""Fixtures shared by the megatron plugin's tests: tiny Hugging Face checkpoints on disk."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from loongsage_plugin_torch.modeling import TINY_QWEN3


def save_tiny_qwen3(out: str, seed: int = 0, **overrides: Any) -> str:
    """Write a tiny Qwen3 (``TINY_QWEN3`` with ``overrides``) initialised from ``seed`` to ``out``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = {**TINY_QWEN3, **overrides}
    model_type = conf.pop("model_type")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **conf), dtype=torch.float32)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_qwen3_writer() -> Any:
    """:func:`save_tiny_qwen3`, for tests that need more checkpoints (test modules cannot import
    this file under ``--import-mode=importlib``)."""
    return save_tiny_qwen3


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    """The tiny Qwen3 checkpoint both backends and both teachers load."""
    return save_tiny_qwen3(str(tmp_path_factory.mktemp("tiny_qwen3")))
