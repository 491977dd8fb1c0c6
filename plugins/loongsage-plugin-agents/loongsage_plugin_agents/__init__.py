"""LoongSage plugin: built-in agents (single-turn, tool agent, black-box command agent), sandboxes and
router middleware."""

__version__ = "0.1.0"
