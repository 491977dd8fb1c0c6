"""LoongSage plugin: verifiers environments as data sources (``verifiers``), agents
(``verifiers``) and rewards (``verifiers``). See the package README."""
