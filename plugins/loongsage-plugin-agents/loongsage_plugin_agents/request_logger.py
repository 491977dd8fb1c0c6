"""Router middleware that appends every request and response to a JSONL file.

One line per event: ``{"time", "trajectory_id", "event": "request" | "response", "body"}``,
where ``body`` is the OpenAI request or response object. Useful to replay or debug what an agent
sent; lines are flushed as they are written.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any


class RequestLogger:
    """Router middleware: log requests and responses as JSON lines to ``path``.

    Args:
        path: the JSONL file (parent directories are created; lines are appended).
        requests, responses: which events to log.
    """

    changes_response = False  # the ObservingMiddleware capability: streaming leaves it out of partial views

    def __init__(self, path: str, requests: bool = True, responses: bool = True) -> None:
        if not isinstance(path, str) or not path:
            raise ValueError("request_logger: 'path' must be a file path")
        self.path = os.path.abspath(os.path.expanduser(path))
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.requests, self.responses = requests, responses
        self._lock = threading.Lock()

    def _write(self, trajectory_id: str, event: str, body: dict[str, Any]) -> None:
        line = json.dumps({"time": time.time(), "trajectory_id": trajectory_id, "event": event, "body": body},
                          ensure_ascii=False, default=str)
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def on_request(self, trajectory_id: str, request: dict[str, Any]) -> dict[str, Any]:
        if self.requests:
            self._write(trajectory_id, "request", request)
        return request

    def on_response(self, trajectory_id: str, request: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
        if self.responses:
            self._write(trajectory_id, "response", response)
        return response
