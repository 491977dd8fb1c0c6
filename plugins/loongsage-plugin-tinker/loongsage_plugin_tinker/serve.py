"""Starting and stopping a Tinker service: the models it serves, its API key, its HTTP server."""

from __future__ import annotations

import secrets
import tempfile
from pathlib import Path
from typing import Any

import attrs

from .app import TinkerApp
from .batches import TinkerRequestError
from .service import TinkerService

API_KEY_PREFIX = "tml-"
"""The SDK accepts only keys with this prefix."""


def served_models(job: Any, model_args: list[str]) -> dict[str, str]:
    """The servable models: the job's ``[model] path`` and every ``--model [NAME=]DIR``, by name
    (the name a client passes as ``base_model``; a directory's own path when no NAME is given)."""
    models: dict[str, str] = {}
    entries = ([job.resolve_path(job.model.path)] if job.model.path else []) + list(model_args)
    for entry in entries:
        name, sep, directory = str(entry).partition("=")
        if not sep:
            name, directory = entry, entry
        path = Path(directory).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise TinkerRequestError(f"--model {entry}: {path} is not a Hugging Face model directory (no config.json)")
        models[str(name)] = str(path)
    if not models:
        raise TinkerRequestError("no model to serve: give --model DIR (a local Hugging Face directory) or a job file "
                                 "with [model] path")
    return models


@attrs.define
class RunningService:
    """A started service: its base URL and API key (what ``TINKER_BASE_URL`` / ``TINKER_API_KEY`` take)."""

    base_url: str
    api_key: str
    server: Any
    service: TinkerService

    def stop(self) -> None:
        self.server.stop()


def start_service(job: Any, host: Any, models: dict[str, str], *, port: int = 0, api_key: str | None = None,
                  state_dir: str | None = None, max_engines: int = 2) -> RunningService:
    """Serve ``models`` on 127.0.0.1:``port`` (0: a free one) from a background thread."""
    from loongsage_core.backend_api.serving import ThreadedServer

    key = api_key or API_KEY_PREFIX + secrets.token_urlsafe(24)
    if not key.startswith(API_KEY_PREFIX):
        raise TinkerRequestError(f"the API key must start with {API_KEY_PREFIX!r} (the tinker SDK refuses others)")
    state = Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix="loongsage-tinker-"))
    state.mkdir(parents=True, exist_ok=True)
    service = TinkerService(job, host, models, state, max_engines=max_engines)
    server = ThreadedServer(TinkerApp(service, key).build(), host="127.0.0.1", port=port, name="tinker-serve")
    url = server.start()
    return RunningService(base_url=url, api_key=key, server=server, service=service)
