"""LoongSage plugin: Megatron-Core trainer and teacher backend via Megatron-Bridge."""

__version__ = "0.1.0"
