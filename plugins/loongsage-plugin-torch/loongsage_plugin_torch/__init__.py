"""LoongSage plugin: Embedded PyTorch trainer, embedded rollout engine and weight transports (runs on one CPU machine)."""

__version__ = "0.1.0"
