"""LoongSage plugin: On-policy distillation: teacher providers and distillation KL strategies."""

__version__ = "0.1.0"
