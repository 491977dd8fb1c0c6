"""Shared set-up of the megatron plugin's tests: tiny Hugging Face checkpoints on disk, and the
import path of ``megatron_test_support``.

The tests run with ``--import-mode=importlib``, so a test module cannot import another one; the
helpers several of them share live in ``megatron_test_support.py`` beside them, and this folder is
put at the front of ``sys.path`` (conftest files load before the test modules are collected) so
that they can ``import megatron_test_support``. Processes they spawn inherit that ``sys.path``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from loongsage_plugin_torch.modeling import TINY_QWEN3

from loongsage_core.plugins import PluginHost

# Test modules cannot import each other under --import-mode=importlib: this folder goes first on
# sys.path so that they (and the rank processes they spawn) import megatron_test_support by name.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


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


@pytest.fixture(scope="module")
def host() -> PluginHost:
    """A plugin host without extra plugins, one per test module."""
    return PluginHost.create([])
