"""Hook implementations of loongsage-plugin-loggers (the module its entry point names).

The logger classes import rich, tensorboardX and matplotlib only when they first draw or write.
"""

from __future__ import annotations

from typing import Iterator

from loongsage_hookspecs import LoggerSpec, StepTruncation, TrajectoryLogger, hookimpl

from .console import ConsoleLogger
from .jsonl import JsonlLogger
from .tensorboard import TensorBoardLogger
from .wandb_logger import WandbLogger


@hookimpl
def loongsage_loggers() -> Iterator[LoggerSpec]:
    yield LoggerSpec(name="console", factory=ConsoleLogger,
                     description="live progress bar with key metrics (plain lines when not a terminal)",
                     capabilities=(TrajectoryLogger,))
    yield LoggerSpec(name="jsonl", factory=JsonlLogger,
                     description="one JSON object per step appended to <output_dir>/metrics.jsonl",
                     capabilities=(StepTruncation,))
    yield LoggerSpec(name="tensorboard", factory=TensorBoardLogger,
                     description="TensorBoard scalars under <output_dir>/tensorboard",
                     capabilities=(StepTruncation,))
    yield LoggerSpec(name="wandb", factory=WandbLogger,
                     description="Weights & Biases run (offline by default: <output_dir>/wandb, `wandb sync` later)",
                     capabilities=(TrajectoryLogger,))
