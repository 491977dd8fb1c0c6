"""LoongSage plugin: Metrics loggers: console with a live progress bar, JSONL, TensorBoard."""

__version__ = "0.1.0"
