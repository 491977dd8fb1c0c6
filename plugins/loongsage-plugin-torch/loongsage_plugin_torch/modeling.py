"""Loading the policy model and tokenizer with transformers, shared by trainer and engine.

A model comes either from a local Hugging Face directory (``[model] path``: config.json +
safetensors + tokenizer files) or, for tests and tiny models, from an inline ``[model] config``
table plus a ``[model] tokenizer`` path; both go through the same transformers classes, so the
code that loads a real checkpoint is the code the tests run.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from loongsage_core.backend_api.models import ModelLoadError, load_causal_lm
from loongsage_hookspecs import JobSettings

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    return getattr(torch, DTYPES[name])


def _resolver(job: JobSettings) -> Callable[[str], str]:
    return job.resolve_path if hasattr(job, "resolve_path") else (lambda p: str(Path(p).resolve()))


def load_model(job: JobSettings, *, seed: int | None = None) -> "PreTrainedModel":
    """Build the causal LM of ``job.model`` in train mode on the CPU, in the configured dtype.

    With ``path`` the weights are read from the directory (safetensors); with an inline
    ``config`` the model is randomly initialised from ``seed`` (default ``job.model.seed``).
    """
    cfg = job.model
    return load_causal_lm(_resolver(job)(cfg.path) if cfg.path else None, cfg.config, torch_dtype(cfg.dtype),
                          cfg.seed if seed is None else seed, path_key="[model] path", config_key="[model] config",
                          owner="[model]")


def tokenizer_path(job: JobSettings) -> str:
    """Where the tokenizer lives: ``[model] tokenizer`` or the model directory."""
    cfg = job.model
    source = cfg.tokenizer or cfg.path
    if not source:
        raise ModelLoadError("[model]: no tokenizer: set 'tokenizer' (a directory) or 'path'")
    return _resolver(job)(source)


def load_tokenizer(job: JobSettings) -> "PreTrainedTokenizerBase":
    """The tokenizer of ``job.model`` (from ``tokenizer`` or, else, the model directory)."""
    from transformers import AutoTokenizer

    path = tokenizer_path(job)
    if not Path(path).exists():
        raise ModelLoadError(f"[model] tokenizer: path '{path}' does not exist")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"[model] tokenizer: cannot load tokenizer from '{path}': {exc}") from None


TINY_QWEN3: dict[str, Any] = {
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
}
"""A tiny Qwen3 configuration matching the vocabulary of tests/data/tokenizer (used by tests)."""


TINY_QWEN2_VL: dict[str, Any] = {
    "model_type": "qwen2_vl",
    "text_config": {
        "vocab_size": 516,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 2,
    },
    "vision_config": {
        "depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2, "patch_size": 4,
        "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
    },
    "vision_start_token_id": 512,
    "vision_end_token_id": 513,
    "image_token_id": 514,
    "video_token_id": 515,
    "tie_word_embeddings": True,
}
"""A tiny Qwen2-VL (vision encoder of one block, 4-pixel patches, the text model of :data:`TINY_QWEN3`'s
size) matching tests/data/vlm (the test tokenizer plus the vision tokens, and its image processor)."""
