"""LoongSage plugin: SGLang rollout engine backend: server actors, native HTTP API, weight updates."""

__version__ = "0.1.0"
