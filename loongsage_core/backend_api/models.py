"""Hugging Face causal LMs from a local directory or an inline config: one loader for trainers,
engines and teachers."""

from __future__ import annotations

from ..hf_models import ModelLoadError, load_causal_lm

__all__ = ["ModelLoadError", "load_causal_lm"]
