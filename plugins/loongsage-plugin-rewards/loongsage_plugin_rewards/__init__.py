"""LoongSage plugin: Verifiable rewards (exact and numeric match, format) and synthetic task generators."""

__version__ = "0.1.0"
