"""LoongSage plugin: metrics loggers (console progress bar, JSONL, TensorBoard) and plots."""

__version__ = "0.1.0"
