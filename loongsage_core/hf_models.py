"""Building a Hugging Face causal LM (and the policy's tokenizer) from a local directory or an
inline config, for every backend.

A model comes either from a local Hugging Face directory (``config.json`` + safetensors) or, for
tests and tiny models, from an inline config table with a ``model_type``; both go through the
same transformers classes, so the code that loads a real checkpoint is the code the tests run.
Imports torch and transformers when called, not at import.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import ConfigError, JobConfig

if TYPE_CHECKING:  # pragma: no cover
    import torch


def load_tokenizer(job: JobConfig) -> Any:
    """The policy tokenizer (``[model] tokenizer`` or the model directory), with a clear error."""
    from transformers import AutoTokenizer

    where = job.source_path or "<job>"
    source = job.model.tokenizer or job.model.path
    if not source:
        raise ConfigError(f"{where}: model: set 'tokenizer' or 'path' so prompts can be tokenized")
    path = Path(job.resolve_path(source))
    if not path.exists():
        key = "model.tokenizer" if job.model.tokenizer else "model.path"
        raise ConfigError(f"{where}: {key}: '{path}' does not exist")
    if job.model.path and not (Path(job.resolve_path(job.model.path)) / "config.json").is_file():
        raise ConfigError(f"{where}: model.path: no config.json in model directory "
                          f"'{job.resolve_path(job.model.path)}'")
    return AutoTokenizer.from_pretrained(str(path))


class ModelLoadError(ValueError):
    """The model cannot be built from what was given; the message names the key at fault."""


def _auto_class(hf_config: Any) -> Any:
    """The transformers auto class for ``hf_config``: a vision-language model (its config has a
    ``vision_config``, e.g. Qwen2-VL) is an image-text-to-text model, anything else a causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if getattr(hf_config, "vision_config", None) is not None \
        else AutoModelForCausalLM


def load_causal_lm(path: str | None, config: dict[str, Any] | None, dtype: "torch.dtype", seed: int, *,
                   path_key: str, config_key: str, owner: str) -> Any:
    """The causal LM in ``path`` (a directory) or, without one, built from ``config`` with its
    weights drawn from ``seed`` (the caller's RNG is left as it was).

    ``path_key``, ``config_key`` and ``owner`` name, in the errors, the setting that gave ``path``,
    the one that gave ``config`` and whose settings these are (e.g. ``[model] path``,
    ``[model] config``, ``[model]``).
    """
    import torch
    from transformers import AutoConfig

    if path:
        directory = Path(path).expanduser()
        if not (directory / "config.json").is_file():
            raise ModelLoadError(f"{path_key}: no config.json in model directory '{directory}'")
        try:
            auto = _auto_class(AutoConfig.from_pretrained(str(directory)))
            return auto.from_pretrained(str(directory), dtype=dtype)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path_key}: cannot load model from '{directory}': {exc}") from None
    if config:
        conf = dict(config)
        model_type = conf.pop("model_type", None)
        if not model_type:
            raise ModelLoadError(f"{config_key}: needs a 'model_type' (e.g. \"qwen3\")")
        try:
            hf_config = AutoConfig.for_model(model_type, **conf)
        except (KeyError, ValueError) as exc:
            raise ModelLoadError(f"{config_key}: {exc}") from None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return _auto_class(hf_config).from_config(hf_config, dtype=dtype)
    raise ModelLoadError(f"{owner}: set 'path' (a Hugging Face directory) or 'config'")
