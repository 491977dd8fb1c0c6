"""LoongSage host: plugin manager, job-file schema, controller, AgentFlow router and CLI.

Importing this package is cheap: torch, ray and transformers are imported only by the modules
that need them, when they are used.
"""

__version__ = "0.1.0"
