"""``loongsage tinker-serve [JOB.toml] [--model [NAME=]DIR ...]``: a Tinker-compatible service.

Added to the ``loongsage`` command through the ``loongsage.commands`` entry-point group; this
module imports only argparse-level things (the parser is built on every ``loongsage`` call).
The job file gives the train backend (``[train]``: backend, micro-batch size, ``[train.lora]``
alpha and dropout, ``backend_args``), the engine (``[rollout]``) and optionally a model
(``[model] path``); without one :file:`default_job.toml` is used (torch backend and engine).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

DEFAULT_JOB = Path(__file__).with_name("default_job.toml")
API_KEY_ENV = "LOONGSAGE_TINKER_API_KEY"
EXIT_USAGE = 2


class TinkerServeCommand:
    """The ``tinker-serve`` subcommand."""

    help = "serve the Tinker training API (the tinker SDK, tinker-cookbook) on local models"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("job", nargs="?", help="TOML job file: train backend, engine, optional [model] "
                                              "(default: the torch backend and engine)")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="override a job-file value by dotted key")
        p.add_argument("--model", action="append", default=[], metavar="[NAME=]DIR",
                       help="a local Hugging Face model directory to serve, as base_model NAME (default: its path); "
                            "repeatable")
        p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: any free port)")
        p.add_argument("--state-dir", help="where checkpoints go (default: a new temporary directory)")
        p.add_argument("--max-engines", type=int, default=2,
                       help="sampling engines kept running at once (default: %(default)s)")

    def run(self, args: argparse.Namespace, load: Callable[[str, list[str]], tuple[Any, Any]]) -> int:
        import threading

        from .batches import TinkerRequestError
        from .serve import served_models, start_service

        job, host = load(args.job or str(DEFAULT_JOB), list(args.overrides))
        try:
            running = start_service(job, host, served_models(job, args.model), port=args.port,
                                    api_key=os.environ.get(API_KEY_ENV), state_dir=args.state_dir,
                                    max_engines=args.max_engines)
        except TinkerRequestError as exc:
            print(f"loongsage: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except OSError as exc:  # the port is taken, or not ours to bind
            print(f"loongsage: error: tinker-serve: cannot listen on 127.0.0.1:{args.port}: {exc.strerror or exc}",
                  file=sys.stderr)
            return EXIT_USAGE
        print(f"Tinker service on {running.base_url} serving {', '.join(sorted(running.service.models))}")
        print(f"export TINKER_BASE_URL={running.base_url}")
        print(f"export TINKER_API_KEY={running.api_key}", flush=True)
        try:
            _stop_on_signals()
            threading.Event().wait()
        except KeyboardInterrupt:
            print("tinker-serve: stopping", file=sys.stderr)
        finally:
            running.stop()
        return 0


def _stop_on_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt, so the service stops its engines and workers
    (SIGINT too when the shell started the command in the background with SIGINT ignored)."""
    import signal

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


COMMAND = TinkerServeCommand()
