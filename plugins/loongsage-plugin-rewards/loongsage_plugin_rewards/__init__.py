"""LoongSage plugin: verifiable rewards and procedural task generators (data sources)."""

__version__ = "0.1.0"
