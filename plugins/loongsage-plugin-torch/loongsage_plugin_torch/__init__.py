"""LoongSage plugin: embedded PyTorch trainer, embedded rollout engine and weight transports.

Everything here runs on one CPU machine (and on GPUs where present).
"""

__version__ = "0.1.0"
