"""A Tinker-compatible service on LoongSage: ``loongsage tinker-serve`` (see README.md)."""
